"""The recipes users run, against figures computed independently: packed RNNs, library activations."""

import copy
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from lightning_hooks import STAT_NAMES, ActivationMonitor, select_modules
from tests.helpers import csv_metrics, loader, trainer

LENGTHS = torch.tensor([7, 5, 5, 4, 3, 3, 2, 1])  # 8 sequences of at most 7 steps, padded


class PackedRNN(L.LightningModule):
    """An LSTM or GRU fed ``pack_padded_sequence``; the loss reads the last hidden state."""

    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = cell(6, 12, batch_first=True)
        self.head = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> Any:
        return self.rnn(pack_padded_sequence(x, LENGTHS, batch_first=True, enforce_sorted=False))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, hidden = self(x)
        last = hidden[0] if isinstance(hidden, tuple) else hidden
        return nn.functional.mse_loss(self.head(last[-1]), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def sequences() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 7, 6, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum((1, 2))[:, None]), batch_size=8)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_a_packed_rnn_is_summarised_over_its_data_and_hidden_states_only(tmp_path, cell):
    model = PackedRNN(cell)
    initial = copy.deepcopy(model)
    monitor = ActivationMonitor(modules="rnn", stats=STAT_NAMES, log_every_n_steps=1)
    trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=1).fit(model, sequences())
    row = csv_metrics(str(tmp_path))[0]

    x, _ = next(iter(sequences()))
    with torch.no_grad():
        packed, hidden = initial(x)
    states = hidden if isinstance(hidden, tuple) else (hidden,)
    values = torch.cat([packed.data.flatten(), *(h.flatten() for h in states)]).double()
    assert packed.data.shape == (int(LENGTHS.sum()), 12)  # no padding in the data
    expected = {"count": values.numel(), "calls": 1, "abs_max": values.abs().max(), "mean": values.mean(),
                "std": values.std(), "min": values.min(), "max": values.max()}
    for stat, value in expected.items():
        assert float(row[f"activations/rnn/{stat}"]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), stat
    assert float(row["activations/rnn/abs_max"]) < 2  # never a batch size (8) or a sort index


def _library_class(module: str, name: str, forward: Any) -> type[nn.Module]:
    """A stand-in for a library's activation class: a plain ``nn.Module`` of that name and module path."""
    return type(name, (nn.Module,), {"forward": lambda self, x: forward(x), "__module__": module, "__qualname__": name})


NewGELUActivation = _library_class("transformers.activations", "NewGELUActivation",
                                   lambda x: nn.functional.gelu(x, approximate="tanh"))
SiLUActivation = _library_class("transformers.activations", "SiLUActivation", nn.functional.silu)
TimmGELU = _library_class("timm.layers.activations", "GELU", nn.functional.gelu)


class LibraryBlocks(L.LightningModule):
    """GPT-2's MLP (``c_fc``, ``act``, ``c_proj``), LLaMA's (``act_fn`` on ``gate_proj``) and a timm MLP's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt2 = nn.ModuleDict({"c_fc": nn.Linear(8, 16), "act": NewGELUActivation(), "c_proj": nn.Linear(16, 8)})
        self.llama = nn.ModuleDict({"gate_proj": nn.Linear(8, 16, bias=False), "up_proj": nn.Linear(8, 16, bias=False),
                                    "act_fn": SiLUActivation(), "down_proj": nn.Linear(16, 8, bias=False)})
        self.timm = nn.ModuleDict({"fc1": nn.Linear(8, 16), "act": TimmGELU(), "fc2": nn.Linear(16, 1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, m = self.gpt2, self.llama
        x = g["c_proj"](g["act"](g["c_fc"](x)))
        x = m["down_proj"](m["act_fn"](m["gate_proj"](x)) * m["up_proj"](x))
        return self.timm["fc2"](self.timm["act"](self.timm["fc1"](x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_the_default_selection_takes_hugging_face_and_timm_activations(tmp_path):
    model = LibraryBlocks()
    initial = copy.deepcopy(model)
    monitor = ActivationMonitor(stats=["mean", "std", "count"], log_every_n_steps=1)
    trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=1).fit(model, loader())
    assert {"gpt2.act", "llama.act_fn", "timm.act"} <= set(monitor.module_names)
    row = csv_metrics(str(tmp_path))[0]
    x, _ = next(iter(loader()))
    with torch.no_grad():
        gelu = initial.gpt2["act"](initial.gpt2["c_fc"](x))
    assert float(row["activations/gpt2.act/count"]) == gelu.numel()
    assert float(row["activations/gpt2.act/mean"]) == pytest.approx(gelu.mean().item(), rel=1e-5)
    assert float(row["activations/gpt2.act/std"]) == pytest.approx(gelu.std().item(), rel=1e-5)


def test_a_real_gpt2_shows_its_activation_functions(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=16, vocab_size=32)
    gpt2 = transformers.GPT2LMHeadModel(config)
    names = [n for n, _ in select_modules(gpt2, None)]
    assert "transformer.h.0.mlp.act" in names and "transformer.h.1.mlp.act" in names
