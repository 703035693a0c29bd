"""Lightning's floor: what its calls into three callbacks cost a step, beside what the Quick start's three cost.

Wraps Lightning's ``_call_callback_hooks`` (the loop that calls one hook on every callback: a profiler
context, the callback's ``state_key`` and the call, per callback) in a ``time.thread_time`` pair, and
fits ``D x Linear(64, 64)`` (never logging) in turns, in one process: plain training, three callbacks
that do nothing (``Callback`` subclasses), and the Quick start's three. Prints, per configuration, the
median step (thread CPU time, as ``not_logged_breakdown.py``) and the CPU time a step spends in
Lightning's callback calls (the callbacks' own hooks included). The three empty callbacks' figure over
plain training's is Lightning's own dispatch: the floor under any three callbacks, before they do anything.

    python benchmarks/lightning_floor.py --depth 10 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
PER_STEP = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
            "on_before_zero_grad", "on_train_batch_end")
SPENT: list[float] = []


def _wrap_dispatch() -> None:
    """Keep the CPU time of each call of Lightning's callback loop for the hooks of every step."""
    from lightning.pytorch.trainer import call

    inner = call._call_callback_hooks

    def timed(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
        if hook_name not in PER_STEP:
            return inner(trainer, hook_name, *args, **kwargs)
        start = time.thread_time()
        try:
            return inner(trainer, hook_name, *args, **kwargs)
        finally:
            SPENT.append(time.thread_time() - start)

    call._call_callback_hooks = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import not_logged_breakdown as nb
    import torch
    from lightning.pytorch import Callback


    torch.set_num_threads(1)
    _wrap_dispatch()
    configs: dict[str, Callable[[], list[Any]]] = {
        "plain": list,
        "three empty callbacks": lambda: [type(f"Empty{i}", (Callback,), {})() for i in range(3)],
        "the Quick start's three": nb.quick_start,
    }
    steps: dict[str, list[float]] = {name: [] for name in configs}
    dispatch: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name in (list(configs) if r % 2 == 0 else list(reversed(configs))):
            SPENT.clear()
            steps[name].append(nb._fit(args.depth, configs[name], args.steps))
            # Six hooks a step: the per-step sum over the fit's steps (warm-up and the first steps included).
            dispatch[name].append(sum(SPENT) / (len(SPENT) / len(PER_STEP)) * 1e6)
    plain, calls = statistics.median(steps["plain"]), statistics.median(dispatch["plain"])
    print(f"\n{args.depth} x Linear(64, 64), {args.rounds} rounds, thread CPU time, medians over rounds (ranges)")
    print(f"{'configuration':28s} {'step (us)':>10s} {'over plain':>11s} {'in callback calls (us/step)':>28s}")
    for name in configs:
        step, spent = statistics.median(steps[name]), statistics.median(dispatch[name])
        print(f"{name:28s} {step:10.0f} {step - plain:11.0f} {spent:12.1f} ({min(dispatch[name]):.1f}-"
              f"{max(dispatch[name]):.1f}), {spent - calls:+.1f} over plain's")


if __name__ == "__main__":
    main()
