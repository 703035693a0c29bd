"""What ``SpikeTrigger(update_norm=...)`` adds to a training step: the update norm measured every step.

The update norm is measured in the optimizer's step hooks (``callbacks/_update_norm.py``): a copy
of the parameters before the step, ``w_before - w_after`` in place after it, one multi-tensor
norm. This times a plain training step (forward, backward, Adam's step) and the same step of a
second copy of the model that has those hooks on for good, alternating step by step in one
process (so the machine's load hits both alike), and gives their ratio; and counts the copies a
step makes (on the CPU the hooks' pass leaves ``w_after`` in the copy and the next step holds
it without one: about 0 a step once the first is made).

    python benchmarks/update_norm.py            # about a minute on 2 cores
    python benchmarks/update_norm.py --steps 20
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
from lightning_hooks.callbacks import _step_copies  # noqa: E402
from lightning_hooks.callbacks._update_norm import UpdateNorms  # noqa: E402

_COPIED = [0]  # elements copied into the step copies so far


def _counting_copy(params: list[torch.Tensor], spares: list, *args: bool) -> tuple:
    _COPIED[0] += sum(param.numel() for param in params)
    return _copies_of(params, spares, *args)


_copies_of, _step_copies.copies_of = _step_copies.copies_of, _counting_copy  # count what the hooks copy


Model = tuple[nn.Module, Callable[[], torch.Tensor]]


def _stack() -> Model:
    torch.manual_seed(0)
    stack = nn.Sequential(*[nn.Linear(64, 64) for _ in range(100)])
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    return stack, lambda: nn.functional.mse_loss(stack(x), y)


def _encoder() -> Model:
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 4)
    tokens = torch.randn(8, 64, 256)
    return encoder, lambda: encoder(tokens).square().mean()


def models() -> dict[str, Callable[[], Model]]:
    """A stack of 100 ``Linear(64, 64)`` (batch 64) and a 4-layer transformer encoder, width 256 (batch 8 x 64)."""
    return {"stack100": _stack, "encoder4x256": _encoder}


def step_seconds(model: nn.Module, loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss().backward()
    optimizer.step()
    return time.perf_counter() - start


def measure(name: str, make: Callable[[], Model], steps: int) -> str:
    """One table line: the plain step, the step with the update norm measured, their ratio, the copies a step.

    Two copies of the model, one with the hooks on for good, step in turn, so a machine whose load
    changes from second to second hits both alike; the ratio is the median of each pair's.
    """
    (model, loss), (watched, watched_loss) = make(), make()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    watched_optimizer = torch.optim.Adam(watched.parameters(), lr=1e-4)
    norms = UpdateNorms()
    handles = norms.register([watched_optimizer])
    for _ in range(3):  # warm-up: the optimizers' state, the copy made once
        step_seconds(model, loss, optimizer), step_seconds(watched, watched_loss, watched_optimizer)
    plain, measured, ratios = [], [], []
    copied = _COPIED[0]
    for _ in range(steps):
        plain.append(step_seconds(model, loss, optimizer))
        measured.append(step_seconds(watched, watched_loss, watched_optimizer))
        ratios.append(measured[-1] / plain[-1])
    assert bool(norms.take(0, torch.device("cpu")).isfinite())
    for handle in handles:
        handle.remove()
    norms.forget()
    a, b = statistics.median(plain) * 1e3, statistics.median(measured) * 1e3
    mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    ratio = statistics.median(ratios)
    copies = (_COPIED[0] - copied) / steps / sum(p.numel() for p in model.parameters())
    return f"| {name} | {mib:.1f} | {a:.2f} | {b:.2f} | {ratio:.3f} | {copies:.2f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="pairs of steps per model")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| model | parameters (MiB) | plain step (ms) | with the update norm (ms) | ratio (median of pairs) |"
          " parameter copies a step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, make in models().items():
        print(measure(name, make, args.steps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
