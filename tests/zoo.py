"""A zoo of awkward modules, and small helpers to train them and read the logs back.

Every callback of this package must survive these without crashing and report true numbers.
:class:`Zoo` chains them all into one trainable network; :func:`zoo_expected` states, worked
out by hand from the shapes, how many calls and output elements each of its modules produces
in one forward of a ``(batch, 4)`` input.

Import as ``from tests.zoo import ...``.
"""

from __future__ import annotations

import csv
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

F = 4  # features of every zoo stage
T = 3  # time steps of the loops


class Shared(nn.Module):
    """One Linear called twice per forward (weight sharing); a ReLU called once between."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(self.act(self.lin(x)))


class DictOutput(nn.Module):
    """Returns a nested dict holding a float tensor, a bool tensor, a string and an int."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> dict[str, Any]:
        y = self.lin(x)
        return {"y": y, "aux": {"mask": y > 0, "note": "not a tensor"}, "k": 3}


@dataclass
class ModelOutput(OrderedDict):
    """Like ``transformers.utils.ModelOutput``: a dataclass that is also an OrderedDict of its
    non-None fields."""

    logits: Optional[Tensor] = None
    hidden_states: Optional[Tensor] = None
    extra: Optional[tuple[Tensor, ...]] = None

    def __post_init__(self) -> None:
        for name in ("logits", "hidden_states", "extra"):
            if getattr(self, name) is not None:
                self[name] = getattr(self, name)


class ModelOutputModule(nn.Module):
    """Returns a :class:`ModelOutput` with ``logits`` (B, F) and ``extra`` ((B, 2),)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, x: Tensor) -> ModelOutput:
        y = self.lin(x)
        return ModelOutput(logits=y, extra=(y[:, :2],))


@dataclass
class Plain:
    """A plain dataclass output: one tensor and one float."""

    value: Tensor
    scale: float


class DataclassOutput(nn.Module):
    def forward(self, x: Tensor) -> Plain:
        return Plain(value=x * 2, scale=2.0)


class NoneOutput(nn.Module):
    """Returns None (a module called only for a side effect)."""

    def forward(self, x: Tensor) -> None:
        return None


class IntBoolOutput(nn.Module):
    """Returns an int64 tensor (B,) and a bool tensor (B, F)."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.argmax(-1), x > 0


class EmptyOutput(nn.Module):
    """Returns a tensor with no elements, (B, 0)."""

    def forward(self, x: Tensor) -> Tensor:
        return x[:, :0]


class ComplexOutput(nn.Module):
    """Returns a complex64 tensor (B, F)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.fft.fft(x)


class SparseOutput(nn.Module):
    """Returns a sparse COO tensor (B, F)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.to_sparse()


class KwargsOnly(nn.Module):
    """A forward that takes keyword arguments only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(F, F)

    def forward(self, *, x: Tensor, scale: float = 1.0) -> Tensor:
        return self.lin(x) * scale


class Raises(nn.Module):
    """Always raises from forward (a fast path that is not available)."""

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("fast path not available")


class Fallback(nn.Module):
    """Tries :class:`Raises`, catches its error and falls back to a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fast = Raises()
        self.slow = nn.Linear(F, F)

    def forward(self, x: Tensor) -> Tensor:
        try:
            return self.fast(x)
        except RuntimeError:
            return self.slow(x)


class Loop(nn.Module):
    """An RNN cell called ``T`` times in a Python loop, then an LSTM over the ``T`` states."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.RNNCell(F, F)
        self.lstm = nn.LSTM(F, F, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        h, states = torch.zeros_like(x), []
        for _ in range(T):
            h = self.cell(x, h)
            states.append(h)
        out, (h_n, _) = self.lstm(torch.stack(states, 1))
        return out[:, -1] + h_n[0]


class Checkpointed(nn.Module):
    """A Linear + Tanh block under non-reentrant gradient checkpointing (recomputed in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(F, F), nn.Tanh())

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


class BasicBlock(nn.Module):
    """A ResNet basic block: in-place ReLUs and an in-place residual add (``out += shortcut``)."""

    def __init__(self, channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += shortcut
        return self.relu(out)


class Unreadable(dict):
    """A dict whose values cannot be listed (a lazily computed output gone wrong)."""

    def values(self) -> Any:
        raise RuntimeError("values are not ready")


class Hostile(nn.Module):
    """Returns a plain dict for its first ``good_calls`` calls, then an :class:`Unreadable` one:
    any hook that walks its output raises from then on."""

    def __init__(self, good_calls: int) -> None:
        super().__init__()
        self.good_calls = good_calls
        self.calls = 0

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        self.calls += 1
        out = {"y": x * 1.0}
        return out if self.calls <= self.good_calls else Unreadable(out)


class Zoo(nn.Module):
    """Every awkward module above, chained into one network from (B, F) to (B, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = Shared()
        self.dict_out = DictOutput()
        self.model_output = ModelOutputModule()
        self.dataclass_out = DataclassOutput()
        self.none_out = NoneOutput()
        self.ints = IntBoolOutput()
        self.empty = EmptyOutput()
        self.complex = ComplexOutput()
        self.sparse = SparseOutput()
        self.kwargs_only = KwargsOnly()
        self.fallback = Fallback()
        self.loop = Loop()
        self.ckpt = Checkpointed()
        self.res = BasicBlock()
        self.head = nn.Linear(F, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.shared(x)
        h = self.dict_out(h)["y"]
        h = self.model_output(h).logits
        h = self.dataclass_out(h).value
        self.none_out(h)
        index, mask = self.ints(h)
        h = h + mask.float() + self.empty(h).sum() + index[:, None].float() * 0
        h = h + self.complex(h).abs()
        h = self.sparse(h).to_dense()
        h = self.kwargs_only(x=h, scale=0.5)
        h = self.fallback(h)
        h = self.loop(h)
        h = self.ckpt(h)
        h = self.res(h.view(-1, 1, 2, 2)).view(-1, F)
        return self.head(h)


def zoo_expected(batch: int) -> dict[str, tuple[int, int]]:
    """``{module: (calls, output elements)}`` for one forward of :class:`Zoo` on ``(batch, F)``.

    Counts are the elements of every tensor a module returns (inside dicts, dataclasses and
    tuples), except sparse and empty tensors. Modules that returned no such tensor (None,
    sparse, empty output, a forward that raised) are absent.
    """
    b = batch
    return {
        "shared": (1, b * F),
        "shared.lin": (2, 2 * b * F),
        "shared.act": (1, b * F),
        "dict_out": (1, 2 * b * F),  # y and its bool mask
        "dict_out.lin": (1, b * F),
        "model_output": (1, b * F + b * 2),  # logits and extra[0]
        "model_output.lin": (1, b * F),
        "dataclass_out": (1, b * F),
        "ints": (1, b + b * F),  # argmax (B,) and mask (B, F)
        "complex": (1, b * F),  # magnitudes
        "kwargs_only": (1, b * F),
        "kwargs_only.lin": (1, b * F),
        "fallback": (1, b * F),
        "fallback.slow": (1, b * F),
        "loop.cell": (T, T * b * F),
        "loop.lstm": (1, b * T * F + 2 * b * F),  # out, h_n, c_n
        "loop": (1, b * F),
        "ckpt": (1, b * F),
        "ckpt.block": (1, b * F),  # recomputation in backward is not a call
        "ckpt.block.0": (1, b * F),
        "ckpt.block.1": (1, b * F),
        "res.conv1": (1, b * F),
        "res.bn1": (1, b * F),
        "res.relu": (2, 2 * b * F),  # the one ReLU is called twice
        "res.conv2": (1, b * F),
        "res.bn2": (1, b * F),
        "res": (1, b * F),
        "head": (1, b),
    }


#: Zoo modules whose output holds nothing to summarise, or that never return.
ZOO_SILENT = ("none_out", "empty", "sparse", "fallback.fast")


class LitNet(pl.LightningModule):
    """Regression on ``net``'s output; optional validation and predict steps."""

    def __init__(self, net: nn.Module, lr: float = 0.01) -> None:
        super().__init__()
        self.net = net
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def zoo_loader(n: int, batch: int, features: int = F, seed: int = 0, out: int = 1) -> DataLoader:
    """A seeded regression DataLoader of ``n`` samples, not shuffled."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return DataLoader(TensorDataset(x, torch.randn(n, out, generator=g)), batch_size=batch)


def metric_series(log_dir: Path | str) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` from a CSVLogger's ``metrics.csv`` (empty cells skipped)."""
    out: dict[str, dict[int, float]] = {}
    with open(Path(log_dir) / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            step = int(row.pop("step"))
            for key, cell in row.items():
                if cell != "":
                    out.setdefault(key, {})[step] = float(cell)
    return out


def tb_scalars(acc: Any, tag: str) -> dict[int, float]:
    """``{step: value}`` of one scalar tag."""
    return {e.step: e.value for e in acc.Scalars(tag)}


def tb_histograms(acc: Any, tag: str) -> dict[int, Any]:
    """``{step: HistogramValue}`` of one histogram tag (fields min, max, num, sum, bucket...)."""
    return {e.step: e.histogram_value for e in acc.Histograms(tag)}


def same(a: float, b: float, rel: float = 1e-5, abs_: float = 1e-6) -> bool:
    """``math.isclose`` that also calls two NaNs the same."""
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=abs_)
