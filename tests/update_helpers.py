"""A backbone + head model and runs for the UpdateTransform tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import trainer

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05),
    "momentum": lambda groups: torch.optim.SGD(groups, lr=0.02, momentum=0.9),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
}


class BackboneHead(L.LightningModule):
    """Linear -> Tanh -> Linear -> Tanh backbone, Linear head; the backbone's param group's lr times ``backbone_lr``."""

    def __init__(self, optimizer: str = "adamw", backbone_lr: float = 1.0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.to(dtype)
        self.optimizer, self.backbone_lr = optimizer, backbone_lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x.to(self.head.weight.dtype)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y.to(self.head.weight.dtype))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = OPTIMIZERS[self.optimizer]([{"params": self.backbone.parameters()},
                                                {"params": self.head.parameters()}])
        optimizer.param_groups[0]["lr"] *= self.backbone_lr
        return optimizer


def data(n: int = 400, batch_size: int = 8) -> DataLoader:
    """A deterministic regression loader: ``n // batch_size`` batches of 8 features."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=gen)
    return DataLoader(TensorDataset(x, torch.sin(x[:, :1] * 2) + x[:, 1:2]), batch_size=batch_size)


def fit(tmp_path: Any, model: L.LightningModule, callbacks: Sequence[L.Callback] = (), steps: int = 50,
        loader: DataLoader | None = None, **kwargs: Any) -> dict[str, torch.Tensor]:
    """Train ``model`` for ``steps`` optimizer steps; its parameters after."""
    kwargs.setdefault("logger", False)
    trainer(tmp_path, callbacks, max_steps=steps, **kwargs).fit(model, loader or data())
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest element difference between two sets of parameters."""
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


class NaNAtStep(BackboneHead):
    """BackboneHead whose loss is NaN at optimizer step ``nan_step``."""

    def __init__(self, optimizer: str = "adamw", backbone_lr: float = 1.0, nan_step: int = 10) -> None:
        super().__init__(optimizer, backbone_lr)
        self.nan_step = nan_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == self.nan_step else loss


class Updates(L.Callback):
    """Each step's update ``w_after - w_before`` per parameter, taken around the training batch."""

    def __init__(self) -> None:
        self.deltas: list[dict[str, torch.Tensor]] = []
        self.before: dict[str, torch.Tensor] = {}
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.deltas.append({n: p.detach() - self.before[n] for n, p in pl_module.named_parameters()})
        self.weights.append(self.before)

    def ratios(self, name: str) -> list[float]:
        """``||Δw|| / ||w_before||`` of parameter ``name`` at each step."""
        return [(d[name].norm() / w[name].norm()).item() for d, w in zip(self.deltas, self.weights)]

    def norms(self) -> list[float]:
        """The whole model's update norm at each step."""
        return [torch.cat([t.reshape(-1) for t in d.values()]).norm().item() for d in self.deltas]
