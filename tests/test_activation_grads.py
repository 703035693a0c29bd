"""ActivationMonitor(gradients=True): dL/d(output) of each selected module, as torch computes it."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hooks import ActivationMonitor
from lightning_hooks.tensorboard_plugin.run_data import TAG, Figure
from tests.helpers import csv_metrics, events, loader, trainer

MODULES = ["block.fc", "block.act", "block", "head"]


class Block(nn.Module):
    """Linear, + input, ReLU: in place or not (the same maths)."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.fc, self.act, self.inplace = nn.Linear(8, 8), nn.ReLU(inplace=inplace), inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.inplace:
            h += x  # on the Linear's output, after its forward hook
        else:
            h = h + x
        return self.act(h)


class DictHead(nn.Linear):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"y": super().forward(x), "unused": x.sum()}


class Net(L.LightningModule):
    def __init__(self, inplace: bool = True, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block, self.head, self.checkpointed = Block(inplace), DictHead(8, 1), checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.head(h)["y"]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def expected_gradients(batches: list[Any], scale: float = 1.0) -> dict[str, torch.Tensor]:
    """dL/d(output) of each module by retain_grad, out of place, over ``batches`` (concatenated)."""
    model, grads = Net(inplace=False), {name: [] for name in MODULES}
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = output["y"] if isinstance(output, dict) else output
            out.retain_grad()
            outputs[name] = out
        return hook

    for name in MODULES:
        model.get_submodule(name).register_forward_hook(keep(name))
    for x, y in batches:
        (model.training_step((x, y), 0) * scale).backward()
        for name in MODULES:
            grads[name].append(outputs[name].grad.reshape(-1))
    return {name: torch.cat(values) for name, values in grads.items()}


def test_each_module_gets_the_gradient_of_its_output_through_inplace_ops_and_dicts(tmp_path):
    stats = ("mean", "min", "max", "abs_max", "count", "calls")
    monitor = ActivationMonitor(MODULES, gradients=True, histogram=False, stats=stats)
    trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=1).fit(Net(), loader())
    row = csv_metrics(str(tmp_path))[0]
    for name, grad in expected_gradients([next(iter(loader()))]).items():
        assert float(row[f"activation_grads/{name}/count"]) == grad.numel()
        assert float(row[f"activation_grads/{name}/calls"]) == 1
        for stat, value in (("mean", grad.mean()), ("min", grad.min()), ("max", grad.max()),
                            ("abs_max", grad.abs().max())):
            assert float(row[f"activation_grads/{name}/{stat}"]) == pytest.approx(value.item(), rel=1e-5, abs=1e-9)
    assert float(row["activation_grads/block.act/abs_max"]) > 0


def test_micro_batches_add_up_and_a_checkpointed_forward_is_watched_once(tmp_path):
    monitor = ActivationMonitor(MODULES, gradients=True, histogram=False, stats=("abs_max", "count", "calls"))
    trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=1, accumulate_grad_batches=2).fit(
        Net(checkpointed=True), loader())
    row = csv_metrics(str(tmp_path))[0]
    batches = list(loader())[:2]
    for name, grad in expected_gradients(batches, scale=0.5).items():  # Lightning halves each micro-batch's loss
        assert float(row[f"activation_grads/{name}/calls"]) == 2
        assert float(row[f"activation_grads/{name}/count"]) == grad.numel()
        assert float(row[f"activation_grads/{name}/abs_max"]) == pytest.approx(grad.abs().max().item(), rel=1e-5)


def test_under_amp_they_are_unscaled_as_the_parameters_gradients_are(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    rows = {}
    for run, kwargs in (("fp32", {}), ("amp", {"plugins": [MixedPrecision(
            "16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))]})):
        monitor = ActivationMonitor(MODULES, gradients=True, histogram=False, stats=("std", "abs_max"))
        trainer(tmp_path / run, [monitor], logger=CSVLogger(tmp_path / run), max_steps=2, **kwargs).fit(
            Net(), loader())
        rows[run] = csv_metrics(str(tmp_path / run))
    for step in (0, 1):  # the scale is taken as each backward runs (a tensor, no sync)
        for name in MODULES:
            for stat in ("std", "abs_max"):
                tag = f"activation_grads/{name}/{stat}"
                fp32, amp = float(rows["fp32"][step][tag]), float(rows["amp"][step][tag])
                assert amp == pytest.approx(fp32, rel=0.05), (step, tag)  # float16 rounding, not 1024x


def test_histograms_and_forward_figures_come_together_only_when_asked(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="", version="")
    trainer(tmp_path, [ActivationMonitor(["block", "head"], gradients=True, log_every_n_steps=2)], logger=logger,
            max_steps=4).fit(Net(), loader())
    acc = events(str(tmp_path))
    assert sorted(acc.Tags()["histograms"]) == ["activation_grads/block", "activation_grads/head",
                                                "activations/block", "activations/head"]
    assert [e.step for e in acc.Histograms("activation_grads/block")] == [0, 1, 3]
    assert acc.Histograms("activation_grads/block")[0].histogram_value.num == 8 * 8
    plain = tmp_path / "plain"
    trainer(plain, [ActivationMonitor(["block"])], logger=TensorBoardLogger(str(plain), name="", version=""),
            max_steps=1).fit(Net(), loader())
    assert not any(t.startswith("activation_grads") for t in events(str(plain)).Tags()["scalars"])


def test_gradients_must_be_a_bool():
    with pytest.raises(TypeError, match="gradients"):
        ActivationMonitor(gradients="yes")


def test_the_layers_tab_draws_them_as_heatmaps_whose_cells_open_their_histograms():
    match = TAG.match("activation_grads/block.fc/std")
    assert match is not None
    assert (match["kind"], match["name"], match["stat"]) == ("activation_grads", "block.fc", "std")
    figure = Figure("activation_grads/std", "", "activation_grads", "std", ["block.fc"], [0], [[1.0]])
    assert figure.histogram_tag(0) == "activation_grads/block.fc"


class UnusedFirst(nn.Module):
    """Returns a dict whose first entry the loss never uses (it gets no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.fc(x)
        return {"unused": h * 2, "used": h}


class LastStateOnly(L.LightningModule):
    """A dict module whose first output is unused, and an LSTM read through ``h_n`` only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.two, self.lstm, self.head = UnusedFirst(), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, (h_n, _) = self.lstm(self.two(x)["used"][:, None, :])
        return nn.functional.mse_loss(self.head(h_n[-1]), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_call_counts_with_whichever_output_gets_a_gradient(tmp_path):
    monitor = ActivationMonitor(["two", "lstm"], gradients=True, histogram=False, stats=("std", "count", "calls"))
    trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=1,
            accumulate_grad_batches=2).fit(LastStateOnly(), loader())
    row = csv_metrics(str(tmp_path))[0]
    assert float(row["activation_grads/two/calls"]) == 2
    assert float(row["activation_grads/two/count"]) == 2 * 8 * 8  # "used" only, in each micro-batch
    assert float(row["activation_grads/lstm/calls"]) == 2
    assert float(row["activation_grads/lstm/count"]) == 2 * 8 * 8  # h_n (1, 8, 8): not `output`, not c_n
    assert float(row["activation_grads/lstm/std"]) > 0
