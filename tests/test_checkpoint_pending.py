"""A checkpoint taken while a step's check waits to be read a step late still holds that step.

With ``warn``, ``raise`` and ``stop`` the check of a step is read at the next step. A checkpoint
saved between the two (ModelCheckpoint at the end of a batch) reads it first and acts on it there:
otherwise a run resumed from that checkpoint never judges that step, and an anomaly on it is lost.
"""

from __future__ import annotations

import logging

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hooks import GradientAnomalyStopping, GradientMonitor, SpikeTrigger
from tests.grad_helpers import GradNet
from tests.helpers import loader, trainer

STEPS, SAVED = 20, 10  # the checkpoint at the end of an epoch of 10 batches, so a resumed run sees the same data


def saver(tmp_path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=SAVED, save_top_k=-1)


def stopper(action: str = "warn") -> GradientAnomalyStopping:
    return GradientAnomalyStopping(action=action, norm_threshold=1e3, spikes=SpikeTrigger(window=8), prog_bar=False)


def fit(tmp_path, callbacks, steps, ckpt_path=None, spike_steps=(SAVED - 1,)):
    torch.manual_seed(0)
    saves = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    run = trainer(tmp_path, callbacks, logger=False, max_steps=steps, limit_val_batches=0, enable_checkpointing=saves)
    run.fit(GradNet(lr=1e-4, spike_steps=spike_steps), loader(n=8 * SAVED), ckpt_path=ckpt_path)
    return run


def test_the_step_before_a_checkpoint_is_judged_in_it_and_a_resumed_run_ends_as_one_never_stopped(tmp_path, caplog):
    saving = stopper()
    with caplog.at_level(logging.WARNING, logger="lightning_hooks"):
        fit(tmp_path / "a", [saving, saver(tmp_path)], SAVED)
    (path,) = tmp_path.glob("*.ckpt")
    (state,) = [s for k, s in torch.load(path, weights_only=False)["callbacks"].items() if "GradientAnomaly" in k]
    assert state["anomalous_steps"] == 1 and state["spikes"][0]["count"] == SAVED  # the last step's check is in
    assert any("Gradient anomaly at step 9" in r.getMessage() for r in caplog.records)

    resumed, whole = stopper(), stopper()
    fit(tmp_path / "b", [resumed], STEPS, ckpt_path=path)
    fit(tmp_path / "c", [whole], STEPS)
    assert resumed.anomalous_steps == whole.anomalous_steps  # the counters came with the checkpoint
    rings = [s._watch.spikes.windows._rings[0] for s in (resumed, whole)]
    assert rings[0].count == rings[1].count == STEPS and torch.equal(rings[0].ordered(), rings[1].ordered())
    medians = [s._detector.state_dict() for s in (resumed, whole)]
    assert medians[0]["seen"] == medians[1]["seen"]


def test_a_stop_due_on_the_step_before_a_checkpoint_stops_there(tmp_path):
    saving = stopper("stop")
    run = fit(tmp_path, [saving, saver(tmp_path)], STEPS)
    assert saving.last_report.step == SAVED - 1 and run.global_step == SAVED  # acted on at the checkpoint


def test_a_monitors_checkpoint_holds_the_step_before_it(tmp_path):
    monitor = GradientMonitor(log_every_n_steps=50, relative_threshold=10.0, histogram=False, prog_bar=False)
    fit(tmp_path, [monitor, saver(tmp_path)], SAVED)
    (path,) = tmp_path.glob("*.ckpt")
    (state,) = [s for k, s in torch.load(path, weights_only=False)["callbacks"].items() if "GradientMonitor" in k]
    assert state["detector"]["seen"] == monitor._detector.state_dict()["seen"] == {0: SAVED}  # the last step too


def test_a_monitors_checkpoint_counts_an_anomaly_on_the_step_before_it(tmp_path):
    monitor = GradientMonitor(log_every_n_steps=50, norm_threshold=1e3, histogram=False, prog_bar=False)
    fit(tmp_path, [monitor, saver(tmp_path)], SAVED)  # the spike at the last step before the checkpoint
    (path,) = tmp_path.glob("*.ckpt")
    (state,) = [s for k, s in torch.load(path, weights_only=False)["callbacks"].items() if "GradientMonitor" in k]
    assert state["anomalies"] == 1
