"""A layer-wise learning rate under AdamW: UpdateTransform does it, GradientTransform cannot.

A backbone is pretrained on one task, then fine-tuned with a new head on another, under AdamW.
The usual recipe: the backbone learns 10x slower than the head. Two ways to ask for it:

* ``GradientTransform(scale={"backbone": 0.1})`` scales the backbone's gradients, which AdamW
  divides by their own running scale: the update is as before (and the callback warns).
* ``UpdateTransform(scale={"backbone": 0.1})`` scales the update ``w_after - w_before`` itself:
  exactly the backbone's param group at ``lr * 0.1``.

``GradientMonitor(update_ratio=True)`` logs ``updates/<param>/ratio``, ``||Δw|| / ||w||`` per
weight, on logged steps; the script reads them back from the event files and prints the
backbone's last Linear against the head (both 64 inputs wide, so at the same learning rate
AdamW moves them by about the same ratio).

    python examples/layerwise_lr.py [log_dir]          # default: runs/layerwise_lr
    tensorboard --logdir runs/layerwise_lr
"""

from __future__ import annotations

import copy
import statistics
import sys
import warnings
from typing import Any

import lightning as L
import torch
from _quiet import quiet_lightning  # Lightning's own noise, silenced by message (see _quiet.py)
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradientMonitor, GradientTransform, UpdateTransform

ROWS = ("backbone.2.weight", "head.weight")


class FineTune(L.LightningModule):
    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone, self.head = backbone, nn.Linear(64, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


def data(task: int, n: int = 2048) -> DataLoader:
    gen = torch.Generator().manual_seed(task)
    x = torch.randn(n, 32, generator=gen)
    y = (x @ torch.randn(32, 4, generator=gen)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=gen)


def pretrained_backbone() -> nn.Module:
    """A backbone trained for 200 steps on task 0 (plain PyTorch: it is only the starting point)."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    head = nn.Linear(64, 4)
    optimizer = torch.optim.AdamW([*backbone.parameters(), *head.parameters()], lr=3e-3)
    for _ in range(5):
        for x, y in data(0):
            optimizer.zero_grad()
            nn.functional.cross_entropy(head(backbone(x)), y).backward()
            optimizer.step()
    return backbone


def fine_tune(log_dir: str, name: str, transform: L.Callback, backbone: nn.Module) -> dict[str, float]:
    """Fine-tune on task 1 with ``transform``; the median update ratio of each row over logged steps."""
    torch.manual_seed(1)
    logger = TensorBoardLogger(log_dir, name=name, version="")
    monitor = GradientMonitor(log_every_n_steps=5, update_ratio=True, histogram=False)
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=logger, callbacks=[transform, monitor],
                        log_every_n_steps=5, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(FineTune(backbone), data(1))
    for warning in caught:
        if "GradientTransform" in str(warning.message):
            print(f"  [{name}] warned: {str(warning.message)[:110]}...")
    logger.experiment.flush()
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {row: statistics.median(e.value for e in events.Scalars(f"updates/{row}/ratio")) for row in ROWS}


def main(log_dir: str = "runs/layerwise_lr") -> None:
    quiet_lightning()
    backbone = pretrained_backbone()
    runs = {
        "GradientTransform": GradientTransform(scale={"backbone": 0.1}),
        "UpdateTransform": UpdateTransform(scale={"backbone": 0.1}),
    }
    print("\nFine-tuning under AdamW, asking for the backbone to learn 10x slower than the head.")
    results = {name: fine_tune(log_dir, name, transform, copy.deepcopy(backbone)) for name, transform in runs.items()}
    print(f"\nMedian update ratio ||dw|| / ||w|| over logged steps, read back from {log_dir}:")
    print(f"{'callback':18} {'backbone.2.weight':>18} {'head.weight':>12} {'head / backbone':>16}")
    for name, ratios in results.items():
        backbone_ratio, head_ratio = ratios["backbone.2.weight"], ratios["head.weight"]
        print(f"{name:18} {backbone_ratio:18.2e} {head_ratio:12.2e} {head_ratio / backbone_ratio:15.1f}x")
    slower = results["UpdateTransform"]["backbone.2.weight"] / results["GradientTransform"]["backbone.2.weight"]
    print(f"\nThe backbone's update ratio under UpdateTransform: {slower:.2f}x its ratio under GradientTransform.")
    print("GradientTransform's gradient scale is divided away by AdamW; UpdateTransform's update scale is not.")


if __name__ == "__main__":
    main(*sys.argv[1:])
