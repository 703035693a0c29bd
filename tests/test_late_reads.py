"""No blocking host read per step where the action allows it: the step's check read a step late.

The step's one transfer (:class:`~lightning_hooks.distributed._rank_agreement.HostTransfer`) is
counted by wrapping it: at which step each transfer was started and at which it was read. With
``warn``, ``raise``, ``stop`` and GradientMonitor's flags on steps not logged it is read at the
next step (the last one at the end of training), and the action happens there, naming the step
that was bad; ``skip``, ``act_late=False`` and a logged step read it before the update. ``rollback``
reads late too: tests/test_late_rollback.py.
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_hooks import GradientAnomalyError, GradientAnomalyStopping, GradientMonitor
from tests._ddp_late import Transfers
from tests.grad_helpers import GradNet
from tests.helpers import csv_metrics, loader, run_ddp, trainer


def run(tmp_path, monkeypatch, callbacks, model=GradNet, steps=6, **kwargs):
    transfers = Transfers(monkeypatch.setattr)  # first: it marks the end before the others' on_train_end
    torch.manual_seed(0)
    fit = trainer(tmp_path, [transfers, *callbacks], max_steps=steps, **kwargs)
    fit.fit(model(), loader())
    return fit, transfers


@pytest.mark.parametrize("action", ["warn", "raise", "stop"])
def test_warn_raise_and_stop_read_each_step_at_the_next_with_no_read_in_its_own_step(tmp_path, monkeypatch, action):
    stopper = GradientAnomalyStopping(action=action, prog_bar=False)
    _, transfers = run(tmp_path, monkeypatch, [stopper], logger=False)
    assert transfers.reads == [(step, step + 1) for step in range(5)] + [(5, "end")]


@pytest.mark.parametrize("kwargs", [dict(action="skip"), dict(action="stop", act_late=False),
                                    dict(action="warn", provenance=True)])
def test_skip_and_act_late_off_and_provenance_read_each_step_before_its_update(tmp_path, monkeypatch, kwargs):
    _, transfers = run(tmp_path, monkeypatch, [GradientAnomalyStopping(prog_bar=False, **kwargs)], logger=False)
    assert transfers.reads == [(step, step) for step in range(6)]


def test_gradient_monitor_reads_its_logged_steps_at_once_and_the_others_a_step_late(tmp_path, monkeypatch):
    monitor = GradientMonitor(log_every_n_steps=3, histogram=False, prog_bar=False)
    _, transfers = run(tmp_path, monkeypatch, [monitor], logger=CSVLogger(tmp_path), steps=7)
    # Logged: 0, 2, 5. One read per step, none blocking in a step that is not logged.
    assert transfers.reads == [(0, 0), (1, 2), (2, 2), (3, 4), (4, 5), (5, 5), (6, "end")]


def test_a_late_warning_names_the_bad_step_and_its_batch(tmp_path, monkeypatch, caplog):
    stopper = GradientAnomalyStopping(action="warn", prog_bar=False, norm_threshold=1e3)
    with caplog.at_level(logging.WARNING, logger="lightning_hooks"):
        fit, _ = run(tmp_path, monkeypatch, [stopper], lambda: GradNet(spike_steps=(2,)), logger=False)
    (report,) = [r.getMessage() for r in caplog.records if "Gradient anomaly" in r.getMessage()]
    assert "Gradient anomaly at step 2 (epoch 0, batch 2)" in report
    # The spike's update diverges the run: steps 2 to 5 are anomalous, reported once, at the first.
    assert stopper.anomalous_steps == 4 and stopper.last_report.step == 2 and fit.global_step == 6


def test_a_late_stop_applies_the_bad_update_and_drops_the_next(tmp_path, monkeypatch):
    stopper = GradientAnomalyStopping(action="stop", prog_bar=False, norm_threshold=1e3)
    fit, transfers = run(tmp_path, monkeypatch, [stopper], lambda: GradNet(spike_steps=(2,)), steps=20, logger=False)
    assert stopper.last_report.step == 2 and stopper.dropped_steps == 1  # step 3's update, not step 2's
    assert fit.global_step == 4  # the dropped step counts, and fit ends
    assert transfers.reads[-1] == (3, "end")  # step 3 read at the end: anomalous too, nothing left to drop
    assert stopper.anomalous_steps == 2


def test_a_late_raise_raises_at_the_next_step_naming_the_bad_one(tmp_path, monkeypatch):
    stopper = GradientAnomalyStopping(action="raise", prog_bar=False)
    with pytest.raises(GradientAnomalyError, match="Gradient anomaly at step 2"):
        run(tmp_path, monkeypatch, [stopper], lambda: GradNet(nan_steps=(2,)), logger=False)


def test_the_last_step_is_acted_on_at_the_end_of_training(tmp_path, monkeypatch, caplog):
    stopper = GradientAnomalyStopping(action="warn", norm_threshold=1e3)  # prog_bar: left alone at the end
    with caplog.at_level(logging.WARNING, logger="lightning_hooks"):
        run(tmp_path, monkeypatch, [stopper], lambda: GradNet(spike_steps=(5,)), logger=False)
    assert any("Gradient anomaly at step 5" in r.getMessage() for r in caplog.records)
    assert stopper.anomalous_steps == 1 and stopper.streak == 1


def test_gradient_monitor_logs_late_flags_at_their_own_step(tmp_path, monkeypatch):
    def flags(path, **kwargs):
        monitor = GradientMonitor(log_every_n_steps=50, norm_threshold=1e3, histogram=False, prog_bar=False, **kwargs)
        run(path, monkeypatch, [monitor], lambda: GradNet(spike_steps=(2,)), logger=CSVLogger(path))
        return {int(row["step"]): float(row["anomalies/exploding"]) for row in csv_metrics(str(path))
                if row.get("anomalies/exploding")}

    late = flags(tmp_path / "late")
    assert late[0] == 0.0 and 1 not in late and late[2] == 1.0  # no logger call on a quiet step
    assert late == flags(tmp_path / "now", provenance=True)  # provenance reads every step at once


@pytest.mark.slow
def test_ddp_both_ranks_read_late_and_stop_together(tmp_path):
    ranks = run_ddp("_ddp_late.py", tmp_path, timeout=90)
    for rank in ranks:  # step 0 is logged by the monitor: read at once; the NaN of rank 1 at step 3 stops both
        assert rank["reads"] == [[0, 0], [1, 2], [2, 3], [3, 4], [4, "end"]]
        assert (rank["global_step"], rank["report_step"], rank["dropped_steps"]) == (5, 3, 1)
    assert ranks[0] == ranks[1]


class NoSyncStopper(GradientAnomalyStopping):
    """Its step check runs with any synchronizing CUDA call raising, from the second step on."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 0:  # the first: nothing pending yet, and the first allocations
            return super().on_before_optimizer_step(trainer, pl_module, optimizer)
        torch.cuda.set_sync_debug_mode("error")
        try:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_clean_step_checked_late_never_synchronizes(tmp_path):
    stopper = NoSyncStopper(action="warn", prog_bar=False)
    torch.manual_seed(0)
    fit = trainer(tmp_path, [stopper], logger=False, max_steps=6, accelerator="gpu", devices=1)
    fit.fit(GradNet(), loader())
    assert fit.global_step == 6 and stopper.anomalous_steps == 0


class Params(L.Callback):
    """The parameters at the start of each training batch."""

    def __init__(self) -> None:
        self.at: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.at[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]


def test_a_late_stop_drops_the_next_update_though_that_step_is_read_at_once(tmp_path, monkeypatch):
    # Step 3 is logged by the monitor, so it is read before its update, right after step 2 is read late.
    params = Params()
    stopper = GradientAnomalyStopping(action="stop", prog_bar=False, norm_threshold=1e3)
    monitor = GradientMonitor(log_every_n_steps=4, histogram=False, prog_bar=False)
    fit, transfers = run(tmp_path, monkeypatch, [params, stopper, monitor], lambda: GradNet(lr=1e-4, spike_steps=(2,)),
                         steps=20, logger=CSVLogger(tmp_path))
    assert transfers.reads == [(0, 0), (1, 2), (2, 3), (3, 3)]
    assert stopper.last_report.step == 2 and stopper.anomalous_steps == 1 and fit.global_step == 4
    assert not all(torch.equal(a, b) for a, b in zip(params.at[2], params.at[3]))  # step 2's update applied
    assert stopper.dropped_steps == 1
    after = [p.detach() for p in fit.lightning_module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(params.at[3], after))  # step 3's update dropped
