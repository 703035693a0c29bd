"""Chained step copies: a step measured right after another holds the copy the previous step's
measuring pass left, unless a parameter changed in between; the figures stay those of a fresh copy."""

import math
from typing import Any, Callable, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_hooks import GradientMonitor
from lightning_hooks.callbacks._gradient_rows import Row
from lightning_hooks.callbacks._step_copies import step_copies
from lightning_hooks.callbacks._update_norm import UpdateNorms
from lightning_hooks.callbacks._update_ratio import UpdateRatio
from lightning_hooks.measure import _update_passes as passes
from tests.copy_counts import Counts
from tests.grad_helpers import GradNet
from tests.helpers import csv_metrics, loader, trainer

pytestmark = pytest.mark.skipif(not passes.NATIVE_PASSES, reason="chained by the C passes only (not built, or off)")

Change = Callable[[int, nn.Module], None]  # (step, model): what happens to the parameters after that step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))


def _loop(steps: int, next_measured: bool = True, change: Optional[Change] = None,
          rows: Optional[Callable[[nn.Module], list[Row]]] = None) -> tuple[list[list[float]], list[list[float]]]:
    """A plain Adam loop with the ratio of every row measured each step, as GradientMonitor(log_every_n_steps=1).

    Returns the ratios measured and those of an independent computation (float64, from clones
    taken just before each step), per step.
    """
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    chosen = rows(model) if rows is not None else [Row(n, [p]) for n, p in model.named_parameters()]
    ratio, x = UpdateRatio(), torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    got, expected = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        before = {id(p): p.detach().double() for p in model.parameters()}
        ratio.take(chosen, optimizer, next_measured=next_measured)
        optimizer.step()
        got.append(ratio.finish(optimizer, True)[0].values)
        ratio.discard(keep=next_measured)
        expected.append([math.sqrt(sum((p.detach().double() - before[id(p)]).square().sum().item() for p in params)
                                   / sum(before[id(p)].square().sum().item() for p in params))
                         for _, params in chosen])
        if change is not None:
            change(step, model)
    ratio.forget()
    return got, expected


def test_consecutive_measured_steps_copy_once_and_give_the_figures_of_a_fresh_copy_bit_for_bit(monkeypatch):
    counts = Counts(monkeypatch)
    chained, expected = _loop(5)
    every = sum(p.numel() for p in _model().parameters())
    assert counts.copied == [every, 0, 0, 0, 0] and counts.chained == 5  # one copy, then the pass leaves it
    assert all(g == pytest.approx(e, rel=1e-9) for g, e in zip(chained, expected))
    monkeypatch.undo()
    assert chained == _loop(5, next_measured=False)[0]  # the same bits as a copy at every step


def _in_place(step: int, model: nn.Module) -> None:
    with torch.no_grad():
        model[0].weight.mul_(0.5)


def _assigned(step: int, model: nn.Module) -> None:
    model[0].weight.data = model[0].weight.detach() * 0.5  # new memory, the same parameter (no version raised)


def _loaded(step: int, model: nn.Module) -> None:
    state = {k: v * 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # every parameter copied into in place: a rollback's restore does this


def _rolled_back(step: int, model: nn.Module) -> None:
    if step == 1:
        _rolled_back.saved = {k: v.clone() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    elif step == 3:
        model.load_state_dict(_rolled_back.saved)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("change", "copied"), [
    (_in_place, "first weight"), (_assigned, "first weight"), (_loaded, "all"), (_rolled_back, "all at step 4"),
], ids=["in place under no_grad", "p.data = x", "load_state_dict", "a rollback to step 1"])
def test_a_parameter_changed_between_steps_is_copied_afresh_and_the_figure_stays_exact(monkeypatch, change, copied):
    counts = Counts(monkeypatch)
    got, expected = _loop(5, change=change)
    model = _model()
    every, first = sum(p.numel() for p in model.parameters()), model[0].weight.numel()
    if copied == "all at step 4":
        assert counts.copied == [every, 0, 0, 0, every]
    else:
        assert counts.copied == [every] + [every if copied == "all" else first] * 4
    assert counts.chained == 5
    for g, e in zip(got, expected):  # against clones taken just before each step
        assert g == pytest.approx(e, rel=1e-9)


def test_tied_parameters_in_two_rows_are_not_chained_and_stay_exact(monkeypatch):
    counts = Counts(monkeypatch)
    got, expected = _loop(3, rows=lambda m: [Row("a", [m[0].weight, m[2].weight]), Row("b", [m[0].weight])])
    model = _model()
    assert counts.chained == 0 and counts.copied == [model[0].weight.numel() + model[2].weight.numel()] * 3
    assert all(g == pytest.approx(e, rel=1e-9) for g, e in zip(got, expected))


class ClampAfterBatch(L.Callback):
    """Changes the parameters in place between steps (weight clipping, as a WGAN critic's)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for p in pl_module.parameters():
                p.clamp_(-0.05, 0.05)


class ParamsAtStepStart(L.Callback):
    def __init__(self) -> None:
        self.params: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.params[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.params[-trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def ratio(self, step: int, name: str) -> float:  # after: at the batch's end, before the clamp
        before, after = self.params[step][name], self.params[-(step + 1)][name]
        return ((after - before).norm() / before.norm()).item()


@pytest.mark.parametrize("every", [1, 3])
def test_in_a_fit_a_callback_changing_parameters_between_steps_is_seen_and_sparse_logging_chains_nothing(
        tmp_path, monkeypatch, every):
    counts = Counts(monkeypatch)
    torch.manual_seed(0)
    probe, model = ParamsAtStepStart(), GradNet(optimizer="adam")
    callbacks = [GradientMonitor(log_every_n_steps=every, update_ratio=True, histogram=False), probe]
    clamp = every == 1
    trainer(tmp_path, [*callbacks, ClampAfterBatch()] if clamp else callbacks, max_steps=6,
            logger=CSVLogger(tmp_path, name="", version=""), log_every_n_steps=every).fit(model, loader())
    tag = "updates/net.0.weight/ratio"
    got = {int(r["step"]): float(r[tag]) for r in csv_metrics(str(tmp_path)) if r.get(tag, "") != ""}
    assert sorted(got) == ([0, 1, 2, 3, 4, 5] if every == 1 else [0, 2, 5])
    for step, ratio in got.items():
        assert ratio == pytest.approx(probe.ratio(step, "net.0.weight"), rel=1e-5)
    all_params = sum(p.numel() for p in model.parameters())
    if clamp:  # every step chained, and every step's copy made afresh: the clamp changed every parameter
        assert counts.chained == 6 and counts.copied == [all_params] * 6
    else:  # the step after a measured one is not measured: no chained pass, no copy written for it
        assert counts.chained == 0 and counts.copied == [all_params] * 3
    shared = step_copies(model.trainer.optimizers[0])
    assert shared.numel == 0 and shared.spare_numel == 0 and not shared._chains.kept  # nothing held after the fit


@pytest.mark.parametrize("width", [256, 32])
def test_the_update_norm_signal_chains_its_copies_and_its_norms_stay_those_of_a_fresh_copy(monkeypatch, width):
    # Large tensors and small ones alike: the chained pass's views are made once, not at every step.
    counts = Counts(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    norms, x = UpdateNorms(), torch.randn(8, width, generator=torch.Generator().manual_seed(1))
    handles = norms.register([optimizer])
    for step in range(4):
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        before = [p.detach().double() for p in model.parameters()]
        optimizer.step()
        expected = math.sqrt(sum((p.detach().double() - b).square().sum().item()
                                 for p, b in zip(model.parameters(), before)))
        assert norms.take(0, torch.device("cpu")).item() == pytest.approx(expected, rel=1e-9)
        if step == 1:
            _in_place(step, model)  # changed between steps: copied afresh
    every = sum(p.numel() for p in model.parameters())
    assert counts.copied == [every, 0, model[0].weight.numel(), 0] and counts.chained == 4
    for handle in handles:
        handle.remove()
    norms.forget()
    assert step_copies(optimizer).spare_numel == 0 and not step_copies(optimizer)._chains.kept


class TiedNet(L.LightningModule):
    """Two module rows sharing one weight (``a`` and ``b``), as tied input and output embeddings."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.b(torch.tanh(self.a(x)))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_module_rows_sharing_a_weight_are_measured_from_one_copy_each_step(tmp_path, monkeypatch):
    counts = Counts(monkeypatch)
    monitor = GradientMonitor(granularity="module", update_ratio=True, histogram=False, log_every_n_steps=1)
    model = TiedNet()
    trainer(tmp_path, [monitor], max_steps=4, logger=CSVLogger(tmp_path, name="", version="")).fit(model, loader())
    rows = {r["step"]: r for r in csv_metrics(str(tmp_path)) if r.get("updates/a/ratio", "") != ""}
    assert len(rows) == 4 and all(float(r["updates/b/ratio"]) > 0 for r in rows.values())
    every = sum(p.numel() for p in model.parameters())  # the tied weight counted once
    assert counts.chained == 0 and counts.copied == [every] * 4  # a row list naming a weight twice: not chained
