"""A logged step's cost with Lightning's TensorBoardLogger against FastTensorBoardLogger, side by side.

``D x Linear(64, 64)`` (D = 100, 1,000), ActivationMonitor and GradientMonitor with histograms
(128 bins) and no row limit (3,000 histograms a step at 1,000), every step logged, in interleaved
rounds in one process. Each fit is timed whole, the logger's ``finalize`` included (it waits for
the writer to drain: TensorBoard's writer thread framing records with its per-byte Python CRC, or
the package's, in C), beside a plain fit (no callback, Lightning's logger). Prints medians of
seconds per step, the ratio of what logging adds to a plain step (wall, and CPU of every thread),
and the event bytes per step.

    python benchmarks/tensorboard_writer.py [--depths 100 1000] [--steps 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scaling import Stack, _stack_batches  # noqa: E402

from lightning_hooks import ActivationMonitor, FastTensorBoardLogger, GradientMonitor  # noqa: E402

LOGGERS = {"lightning": TensorBoardLogger, "fast": FastTensorBoardLogger}


def fit(depth: int, steps: int, logger_name: str, monitors: bool) -> tuple[float, float, int]:
    """One fit: wall seconds, CPU seconds (every thread of the process) and the event files' bytes."""
    root = tempfile.mkdtemp()
    logger = LOGGERS[logger_name](root, name="", version=0)
    callbacks: list[Any] = [ActivationMonitor(max_rows=None), GradientMonitor(max_rows=None)] if monitors else []
    trainer = pl.Trainer(max_steps=steps, logger=logger, callbacks=callbacks, log_every_n_steps=1,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    model, batches = Stack(depth), DataLoader(_stack_batches(steps), batch_size=None)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.fit(model, batches)  # finalize() flushes and closes the writer: its queue is drained
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    size = sum(os.path.getsize(p) for p in glob.glob(f"{logger.log_dir}/events.out.tfevents.*"))
    return wall, cpu, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print("| modules | MB per logged step | plain step: wall (CPU) s | logged step, Lightning's logger: wall (CPU) s"
          " | logged step, FastTensorBoardLogger: wall (CPU) s | what logging adds, Lightning's / Fast: wall (CPU) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for depth in args.depths:
        runs: dict[str, list[tuple[float, float]]] = {"plain": [], "lightning": [], "fast": []}
        size = 0
        for _ in range(args.rounds):  # interleaved: each round runs the three fits, one after the other
            wall, cpu, _ = fit(depth, args.steps, "lightning", monitors=False)
            runs["plain"].append((wall / args.steps, cpu / args.steps))
            for name in LOGGERS:
                wall, cpu, size = fit(depth, args.steps, name, monitors=True)
                runs[name].append((wall / args.steps, cpu / args.steps))
        plain, slow, fast = ([statistics.median(r[i] for r in runs[k]) for i in (0, 1)]
                             for k in ("plain", "lightning", "fast"))
        added = [(slow[i] - plain[i]) / (fast[i] - plain[i]) for i in (0, 1)]
        print(f"| {depth} | {size / args.steps / 1e6:.2f} | {plain[0]:.3f} ({plain[1]:.3f})"
              f" | {slow[0]:.3f} ({slow[1]:.3f}) | {fast[0]:.3f} ({fast[1]:.3f})"
              f" | {added[0]:.1f}x ({added[1]:.1f}x) |", flush=True)
    checksums(size // args.steps)


def checksums(size: int) -> None:
    """The masked CRC-32C of ``size`` bytes (a logged step's), by TensorBoard's loop, the package's C and numpy."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from lightning_hooks.output import _crc32c

    data, native = os.urandom(size), _crc32c.native
    times = {"TensorBoard's per-byte loop": _timed(masked_crc32c, data)}
    if native is not None:
        times["the package's C"] = _timed(_crc32c.masked, data)
    _crc32c.native = None  # the fallback, as where the extension was not built
    times["the package's numpy"] = _timed(_crc32c.masked, data)
    _crc32c.native = native
    print(f"\nThe checksum of {size / 1e6:.2f} MB (a logged step's records), best of 3:\n")
    print("| how | s | TensorBoard's time / this |\n| --- | --- | --- |")
    slowest = times["TensorBoard's per-byte loop"]
    for name, took in times.items():
        print(f"| {name} | {took:.4f} | {slowest / took:.0f}x |")


def _timed(way: Any, data: bytes) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        way(data)
        best = min(best, time.perf_counter() - start)
    return best


if __name__ == "__main__":
    main()
