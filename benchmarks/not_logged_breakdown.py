"""Where a step that logs nothing goes, with the Quick start's three callbacks: CPU time per call.

Wraps each callback hook of ActivationMonitor, GradientMonitor and GradientAnomalyStopping(action="skip"),
and the shared gradient measurement's parts, in a ``time.thread_time`` pair (the CPU time of the
thread: a time the process waits off the CPU on a loaded machine is not counted); fits
``D x Linear(64, 64)`` plain and with the three (never logging) in one process, in turns, and prints
the median steps (CPU time) and each part's median and mean microseconds per call. The wrappers
cost about 1 us a call themselves.

    python benchmarks/not_logged_breakdown.py --depth 100
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
NEVER = 10**9
HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
         "on_before_optimizer_step")
TIMES: dict[str, list[float]] = collections.defaultdict(list)


def _wrap(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper that keeps each call's CPU time in ``TIMES[label]``."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[label].append(time.thread_time() - start)

    setattr(owner, name, timed)


def _instrument() -> None:
    from lightning_hooks import ActivationMonitor, GradientAnomalyStopping, GradientMonitor
    from lightning_hooks.distributed import _rank_agreement, _shared_measurement, _step_measure
    try:
        from lightning_hooks.measure import _gradient_figures as figures
    except ImportError:  # a tree from before the figures had a module of their own
        from lightning_hooks.measure import anomalies as figures

    for cls in (ActivationMonitor, GradientMonitor, GradientAnomalyStopping):
        for hook in HOOKS:
            _wrap(cls, hook, f"{cls.__name__}.{hook}")
    for owner, name in ((_shared_measurement, "measure_step"), (_shared_measurement, "agree"),
                        (_rank_agreement.Agreed, "checks"), (_step_measure, "gradient_figures"),
                        (_step_measure, "_params_with_grads"), (figures, "_foreach_norms"),
                        (figures, "_stacked"), (_shared_measurement.SharedMeasurement, "_measure"),
                        (GradientMonitor, "_handle")):
        _wrap(owner, name, name if name != "_handle" else "GradientMonitor._handle")
    if hasattr(figures, "tensor_squares"):  # the read in C, on the CPU (a tree from before it has none)
        _wrap(figures, "tensor_squares", "tensor_squares")


def quick_start() -> list[Any]:
    """The Quick start's three callbacks, never logging: every step after the first is a step not logged."""
    from lightning_hooks import ActivationMonitor, GradientAnomalyStopping, GradientMonitor

    return [ActivationMonitor(log_every_n_steps=NEVER, max_rows=None),
            GradientMonitor(log_every_n_steps=NEVER, max_rows=None), GradientAnomalyStopping(action="skip")]


def _fit(depth: int, callbacks: Callable[[], list[Any]], steps: int) -> float:
    """Median CPU microseconds of a step of ``steps`` timed ones."""
    sys.path.insert(0, str(HERE))
    from harness import Config, StepTimer, Workload, run_fit
    from scaling import workloads

    built = workloads([depth], False)[f"stack{depth}"]
    model = built.model()
    timer = StepTimer(10, 5, 60.0)
    run_fit(Workload(lambda: model, built.batches), Config("b", "b", lambda tmp: callbacks()), steps + 11,
            tempfile.mkdtemp(prefix="not_logged_"), "b", extra=[timer])
    return statistics.median(s[2] for s in timer.durations(10)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=100)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import torch


    torch.set_num_threads(1)
    _instrument()

    for round_ in range(args.rounds):
        plain = _fit(args.depth, list, args.steps)
        TIMES.clear()
        three = _fit(args.depth, quick_start, args.steps)
        print(f"round {round_}: plain {plain:.0f} us, the three {three:.0f} us, {three - plain:.0f} us over")
    print(f"{'part':50s} {'median':>8s} {'mean':>8s} (us a call)")
    for label in sorted(TIMES, key=lambda k: -statistics.median(TIMES[k])):
        times = TIMES[label]
        print(f"{label:50s} {statistics.median(times) * 1e6:8.1f} {statistics.mean(times) * 1e6:8.1f} x{len(times)}")


if __name__ == "__main__":
    main()
