"""The update norm as a spike signal: measured in the optimizer's step hooks, one shared copy, judged a step later."""

from __future__ import annotations

import csv
import math
from typing import Any

import lightning as L
import numpy as np
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_hooks import GradientAnomalyStopping, GradientMonitor, SpikeTrigger, UpdateTransform
from lightning_hooks.callbacks import _step_copies
from lightning_hooks.measure import _update_passes as passes
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


def run(tmp_path: Any, callbacks: list[L.Callback], boost: int = BOOST, steps: int = 100, **kwargs: Any) -> BoostNet:
    L.seed_everything(0, verbose=False)
    model = BoostNet(boost)
    trainer(tmp_path, callbacks, max_steps=steps, **{"logger": False, **kwargs}).fit(model, loader(8 * steps))
    return model


@pytest.fixture
def copied(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The elements copied into the optimizers' step copies, one entry per copied parameter (``copies_of`` counted)."""
    counts: list[int] = []
    original = _step_copies.copies_of

    def counting(params: Any, spares: Any, *args: Any) -> Any:
        counts.extend(param.numel() for param in params)
        return original(params, spares, *args)

    monkeypatch.setattr(_step_copies, "copies_of", counting)
    return counts


def test_a_boosted_adam_update_is_flagged_at_the_check_after_it_and_kept_in_the_flight_record(tmp_path, copied):
    stopper = GradientAnomalyStopping(action="skip", spikes=UPDATES, flight_recorder=32, prog_bar=False)
    flags = StepFlags(stopper)
    model = run(tmp_path, [stopper, flags])
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
    # Chained on the CPU: a copy at step 0, and after the dropped update (no pass then); else one a step.
    copies = 2 if passes.NATIVE_PASSES else 100
    assert sum(copied) == copies * sum(p.numel() for p in model.parameters())


def test_a_healthy_adam_run_raises_no_update_norm_flag(tmp_path):
    stopper = GradientAnomalyStopping(action="warn", spikes=UPDATES, flight_recorder=0, prog_bar=False)
    flags = StepFlags(stopper)
    run(tmp_path, [stopper, flags], boost=-1, steps=200)
    assert stopper.anomalous_steps == 0 and not any(flags.flags.values())


def test_without_the_signal_no_step_hook_and_no_copy(tmp_path):
    stopper = GradientAnomalyStopping(action="skip", spikes=SpikeTrigger(window=32, warmup=16), prog_bar=False)
    run(tmp_path, [stopper], steps=10)
    assert stopper._watch.updates is None


def test_beside_update_ratios_and_update_transform_a_step_copies_the_parameters_once(tmp_path, copied):
    def ratios(with_signal: bool) -> dict[tuple[str, str], float]:
        monitor = GradientMonitor(update_ratio=True, update_norms=True, log_every_n_steps=1, prog_bar=False)
        transform = UpdateTransform(scale={"net.0": 0.5})
        callbacks: list[L.Callback] = [monitor, transform]
        if with_signal:
            callbacks.append(GradientAnomalyStopping(action="warn", spikes=UPDATES, prog_bar=False))
        folder = tmp_path / str(with_signal)
        model = run(folder, callbacks, boost=-1, steps=20, logger=CSVLogger(str(folder), name="", version=""))
        total = sum(p.numel() for p in model.parameters())
        # The ratio without the signal, or the signal beside it, is the copies' last reader after
        # each step and leaves the parameters in them (chained): one copy, at step 0.
        steps = 1 if passes.NATIVE_PASSES else 20
        assert sum(copied) == steps * total and len(copied) == steps * len(list(model.parameters()))
        copied.clear()
        return {(row["step"], tag): float(v) for row in csv_metrics(str(folder)) for tag, v in row.items()
                if tag.startswith("updates/") and v}

    alone, shared = ratios(False), ratios(True)
    # With the signal on, the ratios measure the update UpdateTransform made, from the same one copy.
    assert alone.keys() == shared.keys() and any(tag.endswith("/ratio") for _, tag in alone)
    assert all(shared[key] == pytest.approx(alone[key], rel=1e-5) for key in alone)
