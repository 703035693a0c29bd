"""One gradient measurement per optimizer step, however many gradient callbacks read it.

The Quick start attaches ActivationMonitor, GradientMonitor and GradientAnomalyStopping: the
step's gradients are measured once for both gradient callbacks, with one host transfer, and each
still gets its own flags (its own thresholds) and acts on them as it would alone.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_hooks import ActivationMonitor, GradientAnomalyStopping, GradientMonitor
from lightning_hooks.callbacks._gradient_check import GradientCheck
from lightning_hooks.core._compat import callbacks_of
from lightning_hooks.distributed._shared_measurement import SharedMeasurement
from tests.grad_helpers import GradNet, spy_on_measurements
from tests.helpers import csv_metrics, loader, trainer
from tests.test_lbfgs import MAX_ITER, LBFGSNet

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from harness import Config, Workload  # noqa: E402
from transfers import count_transfers  # noqa: E402


def measurement(fit: Any) -> SharedMeasurement:
    """The fit's one measurement: held by the first gradient callback in its ``callbacks``."""
    held = callbacks_of(fit, GradientCheck)[0]._measurement
    assert held is not None
    return held


def quick_start(every: int) -> list[Any]:
    return [ActivationMonitor(log_every_n_steps=every), GradientMonitor(log_every_n_steps=every),
            GradientAnomalyStopping(action="skip")]


@pytest.mark.parametrize("names", [("GradientMonitor",), ("GradientMonitor", "GradientAnomalyStopping")])
def test_the_step_is_read_once_with_one_host_transfer(tmp_path: Path, names: tuple[str, ...]) -> None:
    """One transfer per step in all, whichever callback it is charged to.

    GradientMonitor alone reads a step not logged a step late (the transfer counts where it is
    read); with GradientAnomalyStopping(action="skip") every step is read before its update.
    """
    def callbacks(tmp: str) -> list[Any]:
        return [c for c in quick_start(4) if type(c).__name__ in (*names, "ActivationMonitor")]

    workload = Workload(lambda: GradNet(), lambda n: list(loader(n=8 * n, batch_size=8)))
    config = Config("quick", "quick start", callbacks, logged=lambda step: step == 0 or (step + 1) % 4 == 0)
    counts = count_transfers(workload, config, 8, str(tmp_path), "v", owners={"lightning_hooks": None})
    per_step = {when: sum(c[when] or 0 for c in counts["per_callback"].values()) for when in ("non_logged", "logged")}
    # 8 steps (3 logged: 0, 3, 7): a transfer each, and ActivationMonitor's one at each logged step
    # (GradientMonitor's rows join the check's); the last step's read a step late at the end of training.
    assert per_step["non_logged"] * 5 + per_step["logged"] * 3 == pytest.approx(8 + 3)
    if "GradientAnomalyStopping" in names:  # read before each update
        assert (per_step["non_logged"], per_step["logged"]) == (1, 2)


def _run(tmp_path: Path, callbacks: list[Any]) -> tuple[Any, dict[int, dict[str, str]]]:
    torch.manual_seed(0)
    fit = trainer(tmp_path, callbacks, logger=CSVLogger(tmp_path, name="", version=""), max_steps=6)
    fit.fit(GradNet(spike_steps=(3,), nan_steps=(5,)), loader())
    if not list(tmp_path.glob("metrics.csv")):  # nothing was logged
        return fit, {}
    return fit, {int(r["step"]): {k: v for k, v in r.items() if v != ""} for r in csv_metrics(str(tmp_path))}


def test_both_callbacks_read_one_measurement_and_act_as_they_would_alone(tmp_path: Path, monkeypatch) -> None:
    def make() -> tuple[GradientMonitor, GradientAnomalyStopping]:
        # Their own thresholds: the spike at step 3 is above the monitor's and below the stopper's.
        return (GradientMonitor(log_every_n_steps=2, norm_threshold=1e3),
                GradientAnomalyStopping(action="skip", norm_threshold=1e6))

    alone_monitor, alone_stopper = make()
    _, alone = _run(tmp_path / "monitor", [alone_monitor])
    _run(tmp_path / "stopper", [alone_stopper])

    measured = spy_on_measurements(monkeypatch)
    monitor, stopper = make()
    fit, together = _run(tmp_path / "both", [monitor, stopper])
    assert measured == [0, 1, 2, 3, 4, 5]  # once per step for both
    assert together == alone  # the monitor logs what it logs alone (the stopper drops the last update only)
    assert together[3]["anomalies/exploding"] == "1.0" and together[5]["anomalies/nonfinite"] == "1.0"
    assert (monitor.anomalous_steps, stopper.anomalous_steps) == (alone_monitor.anomalous_steps, 1)
    assert (stopper.dropped_steps, alone_stopper.dropped_steps) == (1, 1)
    assert measurement(fit).readers == []  # both left when fit ended


def test_a_second_fit_measures_for_the_callbacks_of_that_fit_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    monitor, stopper = GradientMonitor(log_every_n_steps=1), GradientAnomalyStopping()
    first = trainer(tmp_path, [monitor, stopper], max_steps=2, logger=False)
    first.fit(GradNet(), loader())
    of_first = measurement(first)
    assert of_first.rounds == 2 and of_first.readers == []
    second = trainer(tmp_path, [monitor], max_steps=3, logger=False)  # the stopper is not in this one
    second.fit(GradNet(), loader())
    assert measurement(second) is not of_first and measurement(second).rounds == 3 and of_first.rounds == 2


def test_under_lbfgs_each_evaluation_is_measured_once_for_both(tmp_path: Path) -> None:
    """Both callbacks read each closure evaluation's one measurement; the monitor logs the first of each step."""
    def run(folder: Path, callbacks: list[Any]) -> dict[str, Any]:
        torch.manual_seed(0)
        model = LBFGSNet(nan_at=((1, 2),))  # a NaN at the second evaluation of step 1 only
        fit = trainer(folder, callbacks, logger=CSVLogger(folder, name="", version=""), max_steps=3)
        fit.fit(model, loader())
        return {"calls": dict(model.calls), "rounds": measurement(fit).rounds,
                "rows": csv_metrics(str(folder)) if list(folder.glob("metrics.csv")) else [],
                "params": [p.detach().clone() for p in model.parameters()]}

    def make() -> tuple[GradientMonitor, GradientAnomalyStopping]:
        return GradientMonitor(log_every_n_steps=1), GradientAnomalyStopping(action="skip")

    alone_monitor, alone_stopper = make()
    monitor_alone, stopper_alone = run(tmp_path / "m", [alone_monitor]), run(tmp_path / "s", [alone_stopper])
    monitor, stopper = make()
    both = run(tmp_path / "both", [monitor, stopper])
    evaluations = sum(both["calls"].values())
    assert evaluations > 3 and max(both["calls"].values()) <= MAX_ITER + 1
    assert both["rounds"] == evaluations == stopper_alone["rounds"]  # once per evaluation, for both
    assert monitor_alone["rounds"] == 3  # alone, the monitor reads the first evaluation of each step only
    totals = [r["gradients/total_norm"] for r in both["rows"] if r.get("gradients/total_norm")]
    assert len(totals) == 3  # one figure per step
    assert (stopper.anomalous_steps, stopper.dropped_steps) == (alone_stopper.anomalous_steps, 1) == (1, 1)
    for a, b in zip(both["params"], stopper_alone["params"]):
        assert torch.equal(a, b)
