"""What UpdateTransform costs an optimizer step: time beside a plain step, and the memory its hooks allocate.

A plain PyTorch loop (no Trainer: its own time would hide the step's) over an MLP of 4 Linear layers
of width 1024 (4.2 M parameters) under AdamW, batch 256, on the CPU. The configurations run
interleaved, in rounds, each fit's median step time divided by the mean of the plain runs just
before and after it; the median of those ratios over rounds is reported, with the plain-vs-plain
ratio (A/A) as the noise floor. Then, per configuration, every byte the step hooks allocate in one
step (each op's fresh outputs, counted by a ``TorchDispatchMode``), against the bytes of the
parameters selected: at most one copy of them; and beside GradientMonitor's update ratios of every
parameter (their snapshot taken and measured in the same step), against the bytes of all the
parameters: one copy of them serves both (without sharing it was the selected ones twice, and
the ratios' update a second, passing, copy).

Usage::

    python benchmarks/update_transform.py            # 5 rounds of 20 steps, about a minute on 2 cores
    python benchmarks/update_transform.py --quick    # 2 rounds of 5 steps
    python benchmarks/update_transform.py --rounds 9 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_hooks import UpdateTransform  # noqa: E402
from lightning_hooks.callbacks._gradient_rows import Row  # noqa: E402
from lightning_hooks.callbacks._update_ratio import UpdateRatio  # noqa: E402

SELECTED = {"backbone.*": 0.1}  # the first three Linears: 3.1 M of the 4.2 M parameters
CONFIGS: dict[str, Optional[dict[str, Any]]] = {
    "plain": None,
    "plain (A/A)": None,
    "scale": dict(scale=SELECTED),
    "scale + max_ratio": dict(scale=SELECTED, max_ratio={"backbone.*": 0.01}),
    "scale + max_ratio + clip_to_history": dict(scale=SELECTED, max_ratio={"backbone.*": 0.01},
                                                clip_to_history="*"),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                      nn.Linear(1024, 1024), nn.ReLU())
        self.head = nn.Linear(1024, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _setup(config: Optional[dict[str, Any]]) -> tuple[nn.Module, torch.optim.Optimizer, Optional[UpdateTransform]]:
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    transform = None
    if config is not None:
        transform = UpdateTransform(**config)
        transform.on_fit_start(SimpleNamespace(model=model, optimizers=[optimizer]), model)  # type: ignore[arg-type]
    return model, optimizer, transform


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()


def median_step(config: Optional[dict[str, Any]], steps: int) -> float:
    """The median wall time of ``steps`` optimizer steps (after one warm-up step)."""
    model, optimizer, transform = _setup(config)
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
    _step(model, optimizer, x)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _step(model, optimizer, x)
        times.append(time.perf_counter() - start)
    if transform is not None:
        transform.detach()
    return statistics.median(times)


class _Allocated(TorchDispatchMode):
    """Sums the bytes of every fresh tensor an op returns (not a view, not an in-place result)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # In-place ops and views (detach) return storage that already existed.
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.bytes += t.untyped_storage().nbytes()
        return out


def hook_bytes(config: dict[str, Any], ratios: bool = False) -> tuple[int, int]:
    """Bytes the step hooks allocate in one step, and the bytes of the parameters they select.

    ``ratios``: GradientMonitor's update ratios of every parameter measured in the same step (its
    snapshot taken before the step, as in ``on_before_optimizer_step``, and measured after the
    rewrite); then the second number is the bytes of every parameter.
    """
    model, optimizer, transform = _setup(config)
    assert transform is not None
    rewrite, ratio = transform._rewrite, UpdateRatio()
    counted = _Allocated()

    def wrap(hook: Callable[..., Any]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            with counted:
                hook(*args)
        return run

    transform.detach()
    if ratios:
        rows = [Row(name, [p]) for name, p in model.named_parameters()]
        optimizer.register_step_pre_hook(wrap(lambda opt, *_: ratio.take(rows, opt)))
    optimizer.register_step_pre_hook(wrap(rewrite.before_step))
    optimizer.register_step_post_hook(wrap(rewrite.after_step))
    if ratios:
        optimizer.register_step_post_hook(wrap(lambda opt, *_: ratio.finish(opt, True)))
    rewrite.add(0, optimizer, transform._plan.for_optimizer)  # type: ignore[union-attr]
    _step(model, optimizer, torch.randn(256, 1024))
    params = model.parameters() if ratios else transform._plan.params  # type: ignore[union-attr]
    return counted.bytes, sum(p.numel() * p.element_size() for p in params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5 steps")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rounds, steps = (2, 5) if args.quick else (args.rounds, args.steps)
    torch.set_num_threads(1)
    ratios: dict[str, list[float]] = {name: [] for name in CONFIGS if name != "plain"}
    for _ in range(rounds):
        base_before = median_step(None, steps)
        for name, config in CONFIGS.items():
            if name == "plain":
                continue
            took = median_step(config, steps)
            base_after = median_step(None, steps)
            ratios[name].append(took / ((base_before + base_after) / 2))
            base_before = base_after
    print(f"AdamW step, 4 x Linear(1024), batch 256, 1 thread, {rounds} rounds x {steps} steps; "
          f"median step time over plain AdamW (the machine was shared: ratios only)\n")
    print("| configuration | step time / plain | hook allocations per step | selected parameters |")
    print("|---|---|---|---|")
    for name, values in ratios.items():
        config = CONFIGS[name]
        allocated, selected = hook_bytes(config) if config is not None else (0, 0)
        memory = f"{allocated / 2**20:.2f} MiB | {selected / 2**20:.2f} MiB" if config else "- | -"
        print(f"| {name} | {statistics.median(values):.3f} | {memory} |")
    print("\nBeside GradientMonitor(update_ratio=True) on every parameter, in the same step:\n")
    print("| configuration | hook allocations per step | all parameters |")
    print("|---|---|---|")
    for name, config in CONFIGS.items():
        if config is not None:
            allocated, every = hook_bytes(config, ratios=True)
            print(f"| {name} + update ratios | {allocated / 2**20:.2f} MiB | {every / 2**20:.2f} MiB |")


if __name__ == "__main__":
    main()
