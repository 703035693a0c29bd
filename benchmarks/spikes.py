"""What the spike trigger and the flight recorder add to GradientAnomalyStopping, per step, side by side.

Three configurations are timed in interleaved rounds (the harness of ``overhead.py``) on a stack
of 100 ``Linear(64, 64)`` (200 parameters) and the GPT-2-style decoder of ``scaling.py``: plain
training, ``GradientAnomalyStopping(action="skip")``, and the same with
``spikes=SpikeTrigger()`` and ``flight_recorder=128``. Both additions live on device: a few
small kernels per step (two medians per signal, one row copy into the ring) and no host sync of
their own, so the figure to read is the last column: their cost over the stopper alone, as a
share of a plain step.

    python benchmarks/spikes.py                 # about 3 minutes on 2 cores
    python benchmarks/spikes.py --rounds 2 --steps 6   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch
from harness import Config, Schedule, timed_rounds
from scaling import per_step, workloads
from stat_kernels import launches

from lightning_hooks import GradientAnomalyStopping, SpikeTrigger
from lightning_hooks.callbacks._flight_recorder import FlightRecorder
from lightning_hooks.measure.spikes import SpikeWindows

STOPPER, SPIKES = "stopper (skip)", "stopper + spikes + flight recorder"


def configs() -> dict[str, Config]:
    """Plain training, the stopper alone, and the stopper with the spike trigger and a 128-step recorder."""
    return {c.name: c for c in [
        Config("none", "no callbacks (baseline)", lambda tmp: []),
        Config(STOPPER, "GradientAnomalyStopping(action='skip')",
               lambda tmp: [GradientAnomalyStopping(action="skip", prog_bar=False)]),
        Config(SPIKES, "the same with spikes=SpikeTrigger(), flight_recorder=128",
               lambda tmp: [GradientAnomalyStopping(action="skip", prog_bar=False, spikes=SpikeTrigger(),
                                                    flight_recorder=128)]),
    ]}


def report(runs: Any, models: list[str]) -> str:
    lines = ["| model | plain step (ms) | stopper: extra (ms) | + spikes + recorder: extra (ms) |"
             " spikes + recorder alone (ms) | share of a plain step |", "|---|---:|---:|---:|---:|---:|"]
    for model in models:
        base = [s[1] for (kind, _), fits in runs.items() if kind == model for name, f in fits if name == "none"
                for s in f]
        plain = statistics.median(base) * 1e3
        stopper, spikes = per_step(runs, model, STOPPER, 1), per_step(runs, model, SPIKES, 1)
        if stopper is None or spikes is None:
            continue
        added = (spikes - stopper) * 1e3
        lines.append(f"| {model} | {plain:.2f} | {stopper * 1e3:.2f} | {spikes * 1e3:.2f} | {added:.2f} |"
                     f" {added / plain:.1%} |")
    return "\n".join(lines)


def host_cost(params: int, repeats: int = 300) -> dict[str, tuple[float, int]]:
    """Per step, the spike trigger's (judge, then remember) and the recorder's (one row) cost, alone.

    The same calls the stopper makes at every step, on CPU tensors: microseconds (best of 5
    medians: what they add to a step regardless of the machine's load; the timed fits above are
    noisier), and kernel launches (``stat_kernels.launches``: what they would cost on a GPU).
    """
    windows, recorder = SpikeWindows(SpikeTrigger()), FlightRecorder(128)
    norms, loss = torch.rand(params, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    values = torch.stack([loss, norms.norm()])

    def spikes() -> None:
        windows.judge(values)
        windows.remember(values)

    def record() -> None:
        recorder.record(0, loss, norms)

    out = {}
    for name, call in (("spike trigger", spikes), ("flight recorder", record)):
        for _ in range(130):  # a full window: the medians run on 128 values
            call()
        medians = []
        for _ in range(5):
            times = []
            for _ in range(repeats // 5):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
        out[name] = (min(medians) * 1e6, sum(launches(call).values()))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per fit")
    parser.add_argument("--fit-seconds", type=float, default=4.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models = workloads([100], decoder=True)
    schedule = Schedule(steps=args.steps, rounds=args.rounds, warmup=2, min_steps=3, fit_seconds=args.fit_seconds)
    with tempfile.TemporaryDirectory() as tmp:
        runs = timed_rounds(configs(), models, schedule, tmp)
    print(report(runs, list(models)))
    for params in (200, 2000):
        cost = host_cost(params)
        (trigger_us, trigger_kernels), (recorder_us, recorder_kernels) = cost["spike trigger"], cost["flight recorder"]
        print(f"{params} parameters: spike trigger {trigger_us:.0f} us and {trigger_kernels} kernel launches per step,"
              f" flight recorder (128 steps) {recorder_us:.0f} us and {recorder_kernels} launches per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
