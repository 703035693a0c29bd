"""What ``SpikeTrigger(update_norm=...)`` adds to a training step: the update norm measured every step.

The update norm is measured in the optimizer's step hooks (``callbacks/_update_norm.py``): a copy
of the parameters before the step, ``w_before - w_after`` in place after it, one multi-tensor
norm. This times a plain training step (forward, backward, Adam's step) with and without those
hooks, interleaved in one process (so the machine's load hits both alike), and gives their
ratio; and counts the copies and the bytes a step holds.

    python benchmarks/update_norm.py            # about a minute on 2 cores
    python benchmarks/update_norm.py --rounds 3 --steps 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightning_hooks.callbacks._update_norm import UpdateNorms  # noqa: E402


def models() -> dict[str, tuple[nn.Module, Callable[[], torch.Tensor]]]:
    """A stack of 100 ``Linear(64, 64)`` (batch 64) and a 4-layer transformer encoder, width 256 (batch 8 x 64)."""
    torch.manual_seed(0)
    stack = nn.Sequential(*[nn.Linear(64, 64) for _ in range(100)])
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 4)
    tokens = torch.randn(8, 64, 256)
    return {"stack100": (stack, lambda: nn.functional.mse_loss(stack(x), y)),
            "encoder4x256": (encoder, lambda: encoder(tokens).square().mean())}


def step_seconds(model: nn.Module, loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer,
                 steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss().backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def measure(name: str, model: nn.Module, loss: Callable[[], torch.Tensor], rounds: int, steps: int) -> str:
    """One table line: the plain step, the step with the update norm measured, their ratio, the copy's size."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    norms = UpdateNorms()
    plain: list[float] = []
    measured: list[float] = []
    step_seconds(model, loss, optimizer, 3)  # warm-up
    for _ in range(rounds):  # interleaved: the load hits both alike
        plain += step_seconds(model, loss, optimizer, steps)
        handles = norms.register([optimizer])
        measured += step_seconds(model, loss, optimizer, steps)
        for handle in handles:
            handle.remove()
        assert bool(norms.take(0, torch.device("cpu")).isfinite())
    a, b = statistics.median(plain) * 1e3, statistics.median(measured) * 1e3
    mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return (f"| {name} | {mib:.1f} | {a:.2f} | {b:.2f} | {b / a:.3f} | {norms.copies / (rounds * steps):.0f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| model | parameters (MiB) | plain step (ms) | with the update norm (ms) | ratio | copies a step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (model, loss) in models().items():
        print(measure(name, model, loss, args.rounds, args.steps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
