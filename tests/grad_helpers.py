"""Models and recorders for the gradient tests: a layer that turns NaN on cue, a grad recorder."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any, Optional

import lightning as L
import torch
from torch import nn

from lightning_hooks.distributed import _shared_measurement


class NaNAt(nn.Linear):
    """A Linear layer whose output is NaN while ``active``."""

    active = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * float("nan") if self.active else out


class GradNet(L.LightningModule):
    """NaNAt -> act -> NaNAt -> ReLU -> Linear; ``net.2`` outputs NaN at ``nan_steps``.

    Args:
        lr: Learning rate.
        optimizer: ``"sgd"`` or ``"adam"``.
        nan_steps: Global steps at which ``net.2`` outputs NaN (on ``nan_rank`` only, if set).
        nan_rank: The only rank that injects the NaN; None for every rank.
        act: The first activation (``nn.Identity`` makes the net linear, so a big LR diverges).
        groups: Put the first layer in a parameter group of its own.
        spike_steps: Global steps at which the loss is multiplied by 1000 (finite, big gradients).
        nan_batches: Batch indices (in the epoch) at which ``net.2`` outputs NaN.
        first_nan_steps: Global steps at which ``net.0`` outputs NaN.
    """

    def __init__(
        self, lr: float = 0.05, optimizer: str = "sgd", nan_steps: Sequence[int] = (),
        nan_rank: Optional[int] = None, act: type[nn.Module] = nn.Tanh, groups: bool = False,
        spike_steps: Sequence[int] = (), nan_batches: Sequence[int] = (), first_nan_steps: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(NaNAt(8, 16), act(), NaNAt(16, 16), nn.ReLU(), nn.Linear(16, 1))
        self.lr, self.optimizer, self.nan_steps, self.nan_rank = lr, optimizer, set(nan_steps), nan_rank
        self.groups, self.spike_steps = groups, set(spike_steps)
        self.nan_batches, self.first_nan_steps = set(nan_batches), set(first_nan_steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        on_rank = self.nan_rank is None or self.trainer.global_rank == self.nan_rank
        self.net[2].active = on_rank and (self.global_step in self.nan_steps or batch_idx in self.nan_batches)
        self.net[0].active = self.global_step in self.first_nan_steps
        x, y = batch
        scale = 1000.0 if self.global_step in self.spike_steps else 1.0
        return nn.functional.mse_loss(self(x).float(), y) * scale

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.net[0].active = self.net[2].active = False
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params: Any = self.parameters()
        if self.groups:
            first = list(self.net[0].parameters())
            rest = [p for p in self.parameters() if all(p is not q for q in first)]
            params = [{"params": first}, {"params": rest}]
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr)


class GradRecorder(L.Callback):
    """Record, at every optimizer step, the gradients as this callback's turn finds them.

    ``norms[step]`` maps parameter names to gradient norms; ``total[step]`` is
    ``torch.nn.utils.get_total_norm`` over all gradients.
    """

    def __init__(self) -> None:
        self.norms: dict[int, dict[str, float]] = {}
        self.total: dict[int, float] = {}
        self.calls = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.calls += 1
        grads = {n: p.grad for n, p in pl_module.named_parameters() if p.grad is not None}
        step = trainer.global_step
        if not grads:  # dropped by a callback before this one
            return
        self.norms[step] = {n: torch.linalg.vector_norm(g.float()).item() for n, g in grads.items()}
        self.total[step] = torch.nn.utils.get_total_norm(list(grads.values())).item()


def run_example(name: str, log_dir: str) -> None:
    """Run ``examples/<name>.py``'s ``main`` with its logs under ``log_dir``."""
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(examples, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, examples)  # as `python examples/<name>.py` has it: the examples import their helpers
    try:
        spec.loader.exec_module(module)
        module.main(log_dir)
    finally:
        sys.path.remove(examples)


def spy_on_measurements(monkeypatch: Any, exact_only: bool = False) -> list[int]:
    """The global steps at which the shared gradient measurement measured, in order (only the exact ones if asked)."""
    steps: list[int] = []
    original = _shared_measurement.measure_step

    def spy(trainer: Any, optimizer: Any, detectors: Any, shard_groups: Any, exact: bool) -> Any:
        if exact or not exact_only:
            steps.append(trainer.global_step)
        return original(trainer, optimizer, detectors, shard_groups, exact)

    monkeypatch.setattr(_shared_measurement, "measure_step", spy)
    return steps
