"""The benchmark harness: round order, the ratio arithmetic, timed fits and the host-transfer counter."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_hooks import ActivationMonitor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from harness import Config, Device, StepTimer, Workload, analyse, round_order, run_fit  # noqa: E402
from transfers import count_transfers  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


TINY = Workload(Tiny, lambda n: [torch.ones(2, 4)] * n)
NONE = Config("none", "no callbacks", lambda tmp: [])


def test_round_order_puts_a_baseline_first_last_and_after_every_two() -> None:
    names = ["none", "a", "b", "c", "d", "e"]
    order = round_order(names, seed=3)
    assert order == round_order(names, seed=3) and order != round_order(names, seed=4)
    assert order[0] == order[-1] == "none" and sorted(n for n in order if n != "none") == names[1:]
    gaps = "".join("|" if n == "none" else "x" for n in order).split("|")[1:-1]
    assert [len(g) for g in gaps] == [2, 2, 1]


def test_analyse_divides_each_fit_by_the_mean_of_its_neighbouring_baselines() -> None:
    every_other = Config("x/2", "x", lambda tmp: [], logged=lambda step: step % 2 == 0, every=2)
    configs = {"none": NONE, "x/2": every_other}
    # (step, wall s, CPU s): baselines of 10 and 12 ms around a fit whose logged steps take 33 ms
    # and whose others take 22 ms, in CPU time half of that.
    base = [[(s, t, t) for s in range(4)] for t in (0.010, 0.012)]
    fit = [(s, 0.033 if s % 2 == 0 else 0.022, 0.0165 if s % 2 == 0 else 0.011) for s in range(4)]
    runs = {("m", 0): [("none", base[0]), ("x/2", fit), ("none", base[1])]}
    row = analyse(runs, configs, ["m"])["m"]["x/2"]
    assert row["ratio_logged"] == pytest.approx(3.0) and row["ratio_non_logged"] == pytest.approx(2.0)
    assert row["ratio"] == pytest.approx(2.5) and row["ratio_cpu"] == pytest.approx(1.25)
    assert row["ratio_amortised"] == pytest.approx(2.5) and row["amortised_borrowed"] is False
    assert analyse(runs, configs, ["m"])["m"]["none"]["ratio"] == 1.0


def test_run_fit_synchronizes_the_device_before_timing_each_step(tmp_path: Path) -> None:
    calls = []
    device = Device("cpu", lambda: calls.append(1))
    timer = StepTimer(first=1, min_steps=100, budget_s=100.0, synchronize=device.synchronize)
    run_fit(TINY, NONE, 5, str(tmp_path), "v", device, [timer])
    assert len(calls) == 5 and [step for step, _, _ in timer.durations(1)] == [1, 2, 3]
    assert all(wall > 0 for _, wall, _ in timer.durations(1))


def test_count_transfers_charges_each_callback_its_host_transfers_per_step(tmp_path: Path) -> None:
    config = Config("activations/2", "ActivationMonitor every 2 steps",
                    lambda tmp: [ActivationMonitor(log_every_n_steps=2)],
                    logged=lambda step: step == 0 or (step + 1) % 2 == 0)  # steps 0, 1 and 3
    counts = count_transfers(TINY, config, 4, str(tmp_path), "v", owners={"lightning_hooks": None})
    assert counts["per_callback"] == {"ActivationMonitor": {"logged": 1, "non_logged": 0}}
    assert counts["sites"] and all(site.startswith("ActivationMonitor | ") for site in counts["sites"])


def test_scaling_times_the_chosen_configurations_beside_the_baseline(tmp_path: Path, capsys: Any) -> None:
    """benchmarks/scaling.py runs end to end on a small stack, with only the configurations asked for."""
    import scaling

    out = tmp_path / "figures.json"
    chosen = "empty forward hooks;gradient check alone"
    assert scaling.main(["--depths", "4", "--no-decoder", "--rounds", "1", "--steps", "3", "--fit-seconds", "0",
                         "--threads", "0", "--configs", chosen, "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "empty forward hooks" in table and "gradient check alone" in table and "quick start" not in table
    assert json.loads(out.read_text())
    with pytest.raises(SystemExit):
        scaling.main(["--depths", "4", "--no-decoder", "--threads", "0", "--configs", "no such configuration"])
