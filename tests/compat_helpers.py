"""The same small model on each Lightning package's LightningModule, for tests that run both Trainers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as lp
import pytorch_lightning as ptl
import torch
from torch import nn

from tests.grad_helpers import NaNAt

PACKAGES = {"lightning.pytorch": lp, "pytorch_lightning": ptl}


class _Net:
    """Linear -> Tanh -> Linear -> ReLU -> Linear; ``net.2`` outputs NaN at ``nan_steps`` (on ``nan_rank`` only)."""

    def __init__(self, nan_steps: Sequence[int] = (), nan_rank: Optional[int] = None) -> None:
        super().__init__()
        self.net = nn.Sequential(NaNAt(8, 16), nn.Tanh(), NaNAt(16, 16), nn.ReLU(), nn.Linear(16, 1))
        self.nan_steps, self.nan_rank = set(nan_steps), nan_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        on_rank = self.nan_rank is None or self.trainer.global_rank == self.nan_rank
        self.net[2].active = on_rank and self.global_step in self.nan_steps
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class LightningNet(_Net, lp.LightningModule):
    """The model on ``lightning.pytorch``."""


class StandaloneNet(_Net, ptl.LightningModule):
    """The model on the standalone ``pytorch_lightning``."""


def net(package: Any, **kwargs: Any) -> Any:
    """The model on ``package``'s LightningModule."""
    return (LightningNet if package is lp else StandaloneNet)(**kwargs)


def package_trainer(package: Any, tmp_path: Any, callbacks: Any, **kwargs: Any) -> Any:
    """A quiet CPU ``package.Trainer`` writing under ``tmp_path``."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=6, default_root_dir=str(tmp_path), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, logger=False,
    )
    defaults.update(kwargs)
    return package.Trainer(callbacks=callbacks, **defaults)
