"""What ``update_ratio`` adds to a training step, against what issue 35 allows: one copy and one norm.

8 x ``Linear(1024, 1024)`` (8.4 M parameters) under AdamW on the CPU, batch 64, one torch thread,
a plain loop (zero_grad, forward, backward, step), the update ratio of every parameter measured
at every step as GradientMonitor(update_ratio=True, log_every_n_steps=1) does (``UpdateRatio.take``
before the step, ``finish`` after it, the copy's memory kept between steps). Configurations:

- ``plain``: no hooks;
- ``copy + norm``: the goal's allowance: a copy of the parameters into kept memory before the
  step (``_foreach_copy_``) and one norm of them after it (``_foreach_norm``);
- ``ratio, tensor ops``: the update ratio through the multi-tensor ops (as before the C passes,
  and as on a GPU): the copy, a norm of it, the update in the copy, its norm;
- ``ratio, C passes``: the update ratio on the CPU with a copy at every step (as at a measured
  step whose next step is not measured): the copy summing what it moves, one pass over
  ``w_after`` and ``w_before``;
- ``ratio, C passes, chained``: the update ratio on the CPU when the next step is measured too
  (``log_every_n_steps=1``): one pass after the step reads ``w_after`` and the copy, sums the
  update's squares and ``w_after``'s, and writes ``w_after`` into the copy, which the next step
  holds as it is (no copy before the step).

All four run step by step in turn, in one process, so a machine whose load changes hits them
alike; reported: each one's median step (wall, and this thread's CPU time), its median ratio to
the plain step beside it, and the CPU time of its hooks alone, also as a multiple of
``copy + norm``'s (the figure least moved by a loaded machine).

With ``--fit``, Lightning fits of the same model instead (a CSV logger, every step logged, one fit
per configuration per round, interleaved): plain; ``GradientMonitor(histogram=False)``; the same
with ``update_ratio=True`` through the tensor ops and through the C passes; each fit's median step
(wall and the process's CPU time) over the plain fit's of its round.

Usage::

    python benchmarks/update_ratio.py                 # 5 rounds of 10 steps each
    python benchmarks/update_ratio.py --rounds 3 --steps 5
    python benchmarks/update_ratio.py --depth 100 --width 64   # many small parameters
    python benchmarks/update_ratio.py --depth 1000 --width 16 --rounds 3   # 2,000 tensors
    python benchmarks/update_ratio.py --fit --rounds 3 --steps 12
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import StepTimer  # noqa: E402

from lightning_hooks.callbacks._gradient_rows import Row  # noqa: E402
from lightning_hooks.callbacks._update_ratio import UpdateRatio  # noqa: E402
from lightning_hooks.measure import _update_passes  # noqa: E402

Hooks = tuple[Callable[[], None], Callable[[], None]]  # before the step, after it


def _ratio_hooks(model: nn.Module, optimizer: torch.optim.Optimizer, native: bool, chain: bool = False) -> Hooks:
    rows = [Row(name, [p]) for name, p in model.named_parameters()]
    ratio = UpdateRatio()

    def before() -> None:
        _update_passes.NATIVE_PASSES = native
        ratio.take(rows, optimizer, next_measured=chain)

    def after() -> None:
        _update_passes.NATIVE_PASSES = native
        assert ratio.finish(optimizer, True)
        ratio.discard(keep=True)  # the next step is measured too: the copy's memory is kept

    return before, after


def _reference_hooks(model: nn.Module) -> Hooks:
    params = [p.detach() for p in model.parameters()]
    buffers = [torch.empty_like(p) for p in params]

    def before() -> None:
        torch._foreach_copy_(buffers, params)

    def after() -> None:
        torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32)).tolist()

    return before, after


def _no_hooks() -> Hooks:
    return (lambda: None), (lambda: None)


def setups() -> dict[str, Callable[[nn.Module, torch.optim.Optimizer], Hooks]]:
    return {
        "plain": lambda model, optimizer: _no_hooks(),
        "copy + norm": lambda model, optimizer: _reference_hooks(model),
        "ratio, tensor ops": lambda model, optimizer: _ratio_hooks(model, optimizer, False),
        "ratio, C passes": lambda model, optimizer: _ratio_hooks(model, optimizer, True),
        "ratio, C passes, chained": lambda model, optimizer: _ratio_hooks(model, optimizer, True, chain=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration per round")
    parser.add_argument("--fit", action="store_true", help="Lightning fits with GradientMonitor instead")
    parser.add_argument("--depth", type=int, default=8, help="Linear layers (not with --fit)")
    parser.add_argument("--width", type=int, default=1024, help="their width (not with --fit)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.fit:
        fits(args.rounds, args.steps)
        return
    x = torch.randn(64, args.width, generator=torch.Generator().manual_seed(1))
    runs = {}
    for name, make in setups().items():  # one model and optimizer each: their states stay apart
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs[name] = (model, optimizer, make(model, optimizer))
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}

    def step(name: str) -> tuple[float, float, float]:
        """The step's wall and CPU time (this thread), and the CPU time of its hooks."""
        model, optimizer, (before, after) = runs[name]
        start, cpu = time.perf_counter(), time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        hooks = time.thread_time()
        before()
        hooks = time.thread_time() - hooks
        optimizer.step()
        hooks -= time.thread_time()
        after()
        hooks += time.thread_time()
        return time.perf_counter() - start, time.thread_time() - cpu, hooks

    for name in runs:  # warm-up: the optimizer's state and the copies' memory exist
        step(name), step(name)
    for _ in range(args.rounds):
        for _ in range(args.steps):
            for name in runs:
                times[name].append(step(name))
    _report(times, args)


def _report(times: dict[str, list[tuple[float, float, float]]], args: argparse.Namespace) -> None:
    plain = times["plain"]

    def over_plain(name: str, column: int) -> float:
        return statistics.median(t[column] / p[column] for t, p in zip(times[name], plain))

    hooks = {name: statistics.median(t[2] for t in ts) for name, ts in times.items()}
    print(f"{args.depth} x Linear({args.width}, {args.width}), AdamW, batch 64, one thread; {args.rounds} rounds of"
          f" {args.steps} steps,"
          f" the {len(times)} configurations in turn at every step")
    print("| configuration | median step, wall / CPU (ms) | x plain, wall | x plain, CPU | hooks, CPU (ms) |"
          " hooks / copy + norm's |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, ts in times.items():
        wall, cpu = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
        share = f"{hooks[name] / hooks['copy + norm']:.2f}" if name != "plain" else ""
        print(f"| {name} | {wall * 1e3:.1f} / {cpu * 1e3:.1f} | {over_plain(name, 0):.3f} | {over_plain(name, 1):.3f} |"
              f" {hooks[name] * 1e3:.2f} | {share} |")


class _MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _fit(callbacks: list[pl.Callback], steps: int, native: bool, tmp: str) -> tuple[float, float]:
    """One fit's median step, wall and process CPU seconds (2 warm-up steps left out)."""
    _update_passes.NATIVE_PASSES = native
    timer = StepTimer(2, steps, float("inf"))
    data = [torch.randn(64, 1024, generator=torch.Generator().manual_seed(i % 4)) for i in range(steps + 3)]
    trainer = pl.Trainer(max_steps=steps + 3, logger=CSVLogger(tmp), callbacks=[timer, *callbacks],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         log_every_n_steps=1, accelerator="cpu", devices=1)
    trainer.fit(_MLP(), torch.utils.data.DataLoader(data, batch_size=None))
    durations = timer.durations(2)
    return statistics.median(d[1] for d in durations), statistics.median(d[2] for d in durations)


def fits(rounds: int, steps: int) -> None:
    """The ``--fit`` sitting: the four fits in turn, ``rounds`` times; a table of their ratios to plain."""
    from lightning_hooks import GradientMonitor

    logging.disable(logging.WARNING)  # Lightning's start-up lines, once per fit
    warnings.filterwarnings("ignore")
    configs = {
        "plain": (lambda: [], True),
        "GradientMonitor": (lambda: [GradientMonitor(log_every_n_steps=1, histogram=False)], True),
        "+ update_ratio, tensor ops": (lambda: [GradientMonitor(log_every_n_steps=1, histogram=False,
                                                                update_ratio=True)], False),
        "+ update_ratio, C passes": (lambda: [GradientMonitor(log_every_n_steps=1, histogram=False,
                                                              update_ratio=True)], True),
    }
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for name, (callbacks, native) in configs.items():
                got[name].append(_fit(callbacks(), steps, native, tmp))
    print(f"Lightning fits, 8 x Linear(1024, 1024), AdamW, batch 64, one thread, every step logged;"
          f" {rounds} rounds of one fit each ({steps} timed steps)")
    print("| configuration | median step, wall / CPU (ms) | x plain, wall (range) | x plain, CPU (range) |")
    print("|---|---:|---:|---:|")
    for name, runs in got.items():
        cells = []
        for column in (0, 1):
            ratios = [r[column] / p[column] for r, p in zip(runs, got["plain"])]
            cells.append(f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")
        wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        print(f"| {name} | {wall * 1e3:.1f} / {cpu * 1e3:.1f} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
