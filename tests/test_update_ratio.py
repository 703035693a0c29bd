"""GradientMonitor(update_ratio=True): ||Δw|| / ||w|| of logged steps only, AMP, accumulation, skips."""

import math
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_hooks import GradientAnomalyStopping, GradientMonitor, LayerHealth
from lightning_hooks.callbacks import _step_copies
from lightning_hooks.callbacks._step_copies import step_copies
from lightning_hooks.callbacks._update_ratio import UpdateRatio
from lightning_hooks.measure import _update_passes as passes
from tests.grad_helpers import GradNet
from tests.helpers import csv_metrics, loader, trainer


class ParamsAtStepStart(L.Callback):
    """The parameters at the start of each optimizer step, and whether a snapshot was held then."""

    def __init__(self, monitor: GradientMonitor) -> None:
        self.monitor, self.params, self.pending = monitor, {}, []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.pending.append(self.monitor._updates.pending)
        self.params.setdefault(trainer.global_step, {n: p.detach().clone() for n, p in pl_module.named_parameters()})

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.on_train_batch_start(trainer, pl_module, None, 0)

    def ratio(self, step: int, names: list[str]) -> float:
        before, after = self.params[step], self.params[step + 1]
        delta = math.sqrt(sum((after[n] - before[n]).square().sum().item() for n in names))
        return delta / math.sqrt(sum(before[n].square().sum().item() for n in names))


def ratios(tmp_path: Any, tag: str) -> dict[int, float]:
    return {int(r["step"]): float(r[tag]) for r in csv_metrics(str(tmp_path)) if r.get(tag, "") != ""}


def fit(tmp_path: Any, monitor: GradientMonitor, model: L.LightningModule, *extra: L.Callback,
        **kwargs: Any) -> ParamsAtStepStart:
    probe = ParamsAtStepStart(monitor)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer(tmp_path, [*extra, monitor, probe], logger=logger, **kwargs).fit(model, loader())
    return probe


def test_bad_update_ratio_fails_at_construction():
    with pytest.raises(TypeError, match=r"`update_ratio` must be a bool, got 'yes'"):
        GradientMonitor(update_ratio="yes")


def test_ratio_is_the_update_norm_over_the_weight_norm_on_logged_steps_only(tmp_path, monkeypatch):
    taken = []
    original = UpdateRatio.take
    monkeypatch.setattr(UpdateRatio, "take", lambda self, *a: (taken.append(len(a[0])), original(self, *a))[1])
    torch.manual_seed(0)
    monitor = GradientMonitor(log_every_n_steps=2, update_ratio=True, norm_threshold=1e6)  # a check every step
    probe = fit(tmp_path, monitor, GradNet(optimizer="adam"), max_steps=5)
    got = ratios(tmp_path, "updates/net.0.weight/ratio")
    assert sorted(got) == [0, 1, 3] and len(taken) == 3  # snapshots on logged steps only
    assert not any(probe.pending)  # and none is held from one step to the next
    for step, ratio in got.items():
        assert ratio == pytest.approx(probe.ratio(step, ["net.0.weight"]), rel=1e-5)
    log10 = ratios(tmp_path, "updates/net.4.bias/log10_ratio")
    assert log10[3] == pytest.approx(math.log10(probe.ratio(3, ["net.4.bias"])), rel=1e-5)


def test_module_rows_take_the_norm_over_the_module_parameters(tmp_path):
    torch.manual_seed(0)
    monitor = GradientMonitor(granularity="module", update_ratio=True)
    probe = fit(tmp_path, monitor, GradNet(), max_steps=2)
    got = ratios(tmp_path, "updates/net.2/ratio")
    assert got[1] == pytest.approx(probe.ratio(1, ["net.2.weight", "net.2.bias"]), rel=1e-5)


def test_a_row_of_zeros_before_the_step_has_no_ratio_there_and_no_inf_reaches_the_logs(tmp_path):
    torch.manual_seed(0)
    model = GradNet()
    with torch.no_grad():
        model.net[0].bias.zero_()  # as every bias and LayerNorm shift of GPT-2 at initialisation
    monitor, health = GradientMonitor(update_ratio=True), LayerHealth()
    probe = ParamsAtStepStart(monitor)
    loggers = [CSVLogger(tmp_path, name="", version=""), TensorBoardLogger(tmp_path, name="tb")]
    trainer(tmp_path, [monitor, probe, health], logger=loggers, max_steps=3).fit(model, loader())
    got = ratios(tmp_path, "updates/net.0.bias/ratio")
    assert sorted(got) == [1, 2]  # ||w_before|| = 0 at step 0: no ratio is defined there
    assert got[1] == pytest.approx(probe.ratio(1, ["net.0.bias"]), rel=1e-5)
    assert sorted(ratios(tmp_path, "updates/net.0.weight/ratio")) == [0, 1, 2]  # the other rows as ever
    logged = [float(v) for r in csv_metrics(str(tmp_path)) for k, v in r.items() if k.startswith("updates/") and v]
    assert logged and all(math.isfinite(v) for v in logged)
    summary = health.summary()  # judged on the real ratios: the weights' (a bias's are not judged)
    assert "inf" not in summary and summary.startswith("Layer health at step 2")
    assert all(math.isfinite(v) for v in health._latest[("updates", "ratio")].values())


def test_with_accumulation_only_the_real_optimizer_step_is_measured(tmp_path):
    torch.manual_seed(0)
    monitor = GradientMonitor(update_ratio=True)
    probe = fit(tmp_path, monitor, GradNet(), max_steps=3, accumulate_grad_batches=2)
    got = ratios(tmp_path, "updates/net.0.weight/ratio")
    assert sorted(got) == [0, 1, 2]
    assert [got[s] for s in got] == pytest.approx([probe.ratio(s, ["net.0.weight"]) for s in got], rel=1e-5)


def test_a_step_the_grad_scaler_skips_gives_no_ratio(tmp_path):
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # fp16 overflows at first: skipped steps
    monitor = GradientMonitor(update_ratio=True)
    probe = fit(tmp_path, monitor, GradNet(), max_steps=30, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    got = ratios(tmp_path, "updates/net.0.weight/ratio")
    unchanged = {s for s in range(30) if probe.ratio(s, ["net.0.weight"]) == 0.0}
    assert 0 in unchanged and len(got) >= 4  # the scaler backed off for 25 steps, then trained
    assert set(got) == set(range(30)) - unchanged and not any(probe.pending)


def test_an_update_dropped_by_the_anomaly_stopper_gives_no_ratio(tmp_path):
    torch.manual_seed(0)
    monitor = GradientMonitor(update_ratio=True)
    stopper = GradientAnomalyStopping(action="skip", prog_bar=False)
    fit(tmp_path, monitor, GradNet(nan_steps=(1,)), stopper, max_steps=3)
    assert sorted(ratios(tmp_path, "updates/net.0.weight/ratio")) == [0, 2]


def test_dtensor_parameters_are_measured_on_their_local_shards(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        before = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
        weight = nn.Parameter(distribute_tensor(before.clone(), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
        optimizer = torch.optim.SGD([weight], lr=0.1)
        updates = UpdateRatio()
        updates.take([("w", [weight])], optimizer)
        optimizer.step()
        ratios, _ = updates.finish(optimizer, to_host=True)
        assert (ratios.kind, ratios.stat, ratios.rows, ratios.tags) == ("updates", "ratio", ["w"], ["updates/w/ratio"])
        [ratio] = ratios.values
    finally:
        torch.distributed.destroy_process_group()
    assert ratio == pytest.approx(0.1 * 4 / before.norm().item(), rel=1e-6)  # ||0.1 * ones(4, 4)|| = 0.4



class SpareAtStepStart(L.Callback):
    """The elements of copies' memory kept by the optimizer's step copies at the start of each training batch."""

    def __init__(self) -> None:
        self.kept: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.kept.append(step_copies(trainer.optimizers[0]).spare_numel)


def test_a_copy_memory_is_kept_only_for_a_next_step_that_is_measured(tmp_path, monkeypatch):
    # Logged (and measured) steps: 0, 1, 3, 5. Step 0's copy is kept for step 1, which holds it as
    # step 0's measuring pass left it (chained: nothing copied); no memory is held into steps 2
    # and 4, which are not measured, nor after the fit; the ratios stay exact.
    copied: list[tuple[int, int]] = []  # per hold: elements copied into a fresh tensor, into a spare
    original = _step_copies.copies_of

    def counting(params: list[torch.Tensor], spares: list[Any], *args: Any) -> Any:
        into = sum(p.numel() for p, spare in zip(params, spares) if spare is not None)
        copied.append((sum(p.numel() for p in params) - into, into))
        return original(params, spares, *args)

    monkeypatch.setattr(_step_copies, "copies_of", counting)
    torch.manual_seed(0)
    monitor, spare = GradientMonitor(log_every_n_steps=2, update_ratio=True), SpareAtStepStart()
    model = GradNet(optimizer="adam")
    probe = fit(tmp_path, monitor, model, spare, max_steps=6)
    every = sum(p.numel() for p in model.parameters())
    assert spare.kept == [0, every, 0, 0, 0, 0]
    step1 = [] if passes.NATIVE_PASSES else [(0, every)]  # chained on the CPU: no copy; else into step 0's memory
    assert copied == [(every, 0), *step1, (every, 0), (every, 0)]  # steps 0, 1, 3, 5
    shared = step_copies(model.trainer.optimizers[0])
    assert shared.numel == 0 and shared.spare_numel == 0
    got = ratios(tmp_path, "updates/net.0.weight/ratio")
    assert sorted(got) == [0, 1, 3, 5]
    for step, ratio in got.items():
        assert ratio == pytest.approx(probe.ratio(step, ["net.0.weight"]), rel=1e-5)
