"""What keeping the step copies' memory between measured steps saves: the update ratio's hook time per step.

8 x ``Linear(1024, 1024)`` (8.4 M parameters) under AdamW on the CPU, a plain loop (batch 64),
the update ratio of every parameter measured at every step (``UpdateRatio.take`` before the
step, ``finish`` after it, as GradientMonitor(update_ratio=True, log_every_n_steps=1) does).
"kept": the copy's memory is kept for the next step and copied into; "fresh": it is freed at
each step's end (as at a step whose next step is not measured), so each copy is a fresh
allocation; "chained": kept, and the next step measured too, so the pass that measures the
update also writes ``w_after`` into the copy and the next step holds it without a copy
(``take(..., next_measured=True)``, as GradientMonitor logging every step does). The three run
interleaved, in rounds; reported: each one's median hook time, and their ratios per round (the
machine may be shared: ratios only).

Usage::

    python benchmarks/step_copies.py              # 5 rounds of 20 steps
    python benchmarks/step_copies.py --rounds 3 --steps 10
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_hooks.callbacks._gradient_rows import Row  # noqa: E402
from lightning_hooks.callbacks._update_ratio import UpdateRatio  # noqa: E402


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def hook_times(keep: bool, steps: int, chain: bool = False) -> tuple[float, float]:
    """The median time of the update ratio's hooks (take + finish) over ``steps`` steps, and its page faults."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = [Row(name, [p]) for name, p in model.named_parameters()]
    ratio, times, faults = UpdateRatio(), [], []
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1))
    for _ in range(steps + 1):
        optimizer.zero_grad(set_to_none=True)  # a real step between: the allocator's memory moves
        model(x).square().mean().backward()
        start, faulted = time.perf_counter(), _faults()
        ratio.take(rows, optimizer, next_measured=chain)
        took, faulted = time.perf_counter() - start, _faults() - faulted
        optimizer.step()
        start, before = time.perf_counter(), _faults()
        ratio.finish(optimizer, True)
        ratio.discard(keep=keep)  # GradientMonitor's batch end: kept only when the next step is measured
        times.append(took + time.perf_counter() - start)
        faults.append(faulted + _faults() - before)
    ratio.forget()
    return statistics.median(times[1:]), statistics.mean(faults[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    kept, fresh, chained, faults = [], [], [], {False: [], True: []}
    for _ in range(args.rounds):
        for keep, times in ((False, fresh), (True, kept)):
            took, faulted = hook_times(keep, args.steps)
            times.append(took)
            faults[keep].append(faulted)
        chained.append(hook_times(True, args.steps, chain=True)[0])
    ratios = [k / f for k, f in zip(kept, fresh)]
    chain_ratios = [c / k for c, k in zip(chained, kept)]
    print(f"update ratio hooks per step, 8 x Linear(1024, 1024), {args.rounds} rounds of {args.steps} steps:")
    print(f"fresh copy {statistics.median(fresh) * 1e3:.1f} ms, kept memory {statistics.median(kept) * 1e3:.1f} ms, "
          f"kept / fresh {statistics.median(ratios):.2f} (per round {', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"chained {statistics.median(chained) * 1e3:.1f} ms, chained / kept {statistics.median(chain_ratios):.2f}"
          f" (per round {', '.join(f'{r:.2f}' for r in chain_ratios)})")
    print(f"page faults per step in the hooks: fresh {statistics.mean(faults[False]):.0f}, "
          f"kept {statistics.mean(faults[True]):.0f} (a 4 KiB page each; the parameters are "
          f"{8 * (1024 * 1024 + 1024) * 4 // 4096} pages)")


if __name__ == "__main__":
    main()
