"""The update norm as a spike signal: measured in the optimizer's step hooks, one shared copy, judged a step later."""

from __future__ import annotations

import csv
import math
from typing import Any

import lightning as L
import numpy as np
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_hooks import GradientAnomalyStopping, GradientMonitor, SpikeTrigger
from tests.grad_helpers import GradNet
from tests.helpers import csv_metrics, loader, trainer
from tests.test_spikes import StepFlags

BOOST = 60  # the step whose learning rate is x10, under Adam: its update is 10x the usual
UPDATES = SpikeTrigger(loss=None, grad_norm=None, update_norm=6.0, window=32, warmup=16)


class BoostNet(GradNet):
    """GradNet under Adam (lr 1e-2), with the learning rate x10 for one step, ``boost``."""

    def __init__(self, boost: int = BOOST) -> None:
        super().__init__(lr=1e-2, optimizer="adam")
        self.boost = boost

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = self.lr * (10.0 if self.global_step == self.boost else 1.0)


def run(tmp_path: Any, callbacks: list[L.Callback], boost: int = BOOST, steps: int = 100, **kwargs: Any) -> None:
    L.seed_everything(0, verbose=False)
    trainer(tmp_path, callbacks, max_steps=steps, **{"logger": False, **kwargs}).fit(BoostNet(boost), loader(8 * steps))


def test_a_boosted_adam_update_is_flagged_at_the_check_after_it_and_kept_in_the_flight_record(tmp_path):
    stopper = GradientAnomalyStopping(action="skip", spikes=UPDATES, flight_recorder=32, prog_bar=False)
    flags = StepFlags(stopper)
    run(tmp_path, [stopper, flags])
    # An update is known once made: the boosted step's is judged at the next step's check, which drops its update.
    assert [step for step, fired in flags.flags.items() if fired] == [BOOST + 1]
    report = stopper.last_report
    assert report.flags == ("update_norm_spike",) and report.step == BOOST + 1
    record = report.flight_record
    updates = dict(zip(record.steps, record.update_norms))
    usual = np.median([v for step, v in updates.items() if step < BOOST])
    assert updates[BOOST] > 5 * usual and math.isnan(updates[BOOST + 1])  # the anomalous step's is not made yet
    with open(record.path) as f:
        rows = list(csv.DictReader(f))
    assert float(rows[record.steps.index(BOOST)]["update_norm"]) == pytest.approx(updates[BOOST], rel=1e-5)
    assert stopper._watch.updates.copies == 100  # one copy of the parameters per optimizer step


def test_a_healthy_adam_run_raises_no_update_norm_flag(tmp_path):
    stopper = GradientAnomalyStopping(action="warn", spikes=UPDATES, flight_recorder=0, prog_bar=False)
    flags = StepFlags(stopper)
    run(tmp_path, [stopper, flags], boost=-1, steps=200)
    assert stopper.anomalous_steps == 0 and not any(flags.flags.values())
    assert stopper._watch.updates.copies == 200


def test_without_the_signal_no_step_hook_and_no_copy(tmp_path):
    stopper = GradientAnomalyStopping(action="skip", spikes=SpikeTrigger(window=32, warmup=16), prog_bar=False)
    run(tmp_path, [stopper], steps=10)
    assert stopper._watch.updates is None


def test_gradient_monitor_s_update_ratio_reads_the_signal_s_copy_and_logs_the_same_ratios(tmp_path):
    def ratios(with_signal: bool) -> tuple[dict[tuple[str, str], float], GradientMonitor]:
        monitor = GradientMonitor(update_ratio=True, update_norms=True, log_every_n_steps=5, prog_bar=False)
        callbacks: list[L.Callback] = [monitor]
        if with_signal:
            callbacks.append(GradientAnomalyStopping(action="warn", spikes=UPDATES, prog_bar=False))
        folder = tmp_path / str(with_signal)
        run(folder, callbacks, boost=-1, steps=40, logger=CSVLogger(str(folder), name="", version=""))
        found = {(row["step"], tag): float(v) for row in csv_metrics(str(folder)) for tag, v in row.items()
                 if tag.startswith("updates/") and v}
        return found, monitor

    alone, own = ratios(False)
    shared, reader = ratios(True)
    assert own._updates.copies == 9 and reader._updates.copies == 0  # logged steps 0, 4, 9 ... 39: no second copy
    assert alone.keys() == shared.keys() and any(tag.endswith("/ratio") for _, tag in alone)
    assert all(shared[tag] == pytest.approx(alone[tag], rel=1e-6) for tag in alone)
