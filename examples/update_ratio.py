"""Update-to-weight ratios: spot the layer whose learning rate is far off, from ||Δw|| / ||w||.

A three-layer MLP trained with SGD where each Linear has its own parameter group: the first
learns 100x too fast, the last 1000x too slow. ``GradientMonitor(update_ratio=True)`` logs,
on logged steps, ``updates/<param>/log10_ratio``: how far one optimizer step moves each
weight relative to its size. Around -3 (1e-3) is the usual healthy figure; well above -2 the
layer is thrashing, well below -4 it barely learns. The script reads the figures back from
the TensorBoard event files and prints a verdict per layer.

    python examples/update_ratio.py [log_dir]          # default: runs/update_ratio
    tensorboard --logdir runs/update_ratio
"""

from __future__ import annotations

import statistics
import sys

import lightning as L
import torch
from _quiet import quiet_lightning  # Lightning's own noise, silenced by message (see _quiet.py)
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradientMonitor

LR = 0.01
LR_SCALE = {"net.0": 100.0, "net.2": 1.0, "net.4": 0.001}  # the bug: per-layer learning rates far apart


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        modules = dict(self.named_modules())
        groups = [{"params": modules[name].parameters(), "lr": LR * scale} for name, scale in LR_SCALE.items()]
        return torch.optim.SGD(groups, lr=LR)


def data(n: int = 1024) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    return DataLoader(TensorDataset(x, x[:, :4].sum(1, keepdim=True)), batch_size=32, shuffle=True, generator=gen)


def verdict(log10_ratio: float) -> str:
    if log10_ratio > -2:
        return "too fast (lower its learning rate)"
    if log10_ratio < -4:
        return "too slow (raise its learning rate)"
    return "ok"


def main(log_dir: str = "runs/update_ratio") -> None:
    quiet_lightning()
    L.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(log_dir, name="")
    monitor = GradientMonitor(log_every_n_steps=5, update_ratio=True, histogram=False)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=2, logger=logger, callbacks=[monitor], log_every_n_steps=5,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    trainer.fit(MLP(), data())
    logger.experiment.flush()

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    print(f"\nUpdate-to-weight ratio per weight (median over logged steps), from {logger.log_dir}:")
    print(f"{'parameter':14} {'lr':>8} {'log10 ratio':>12}   verdict")
    for name, scale in LR_SCALE.items():
        series = events.Scalars(f"updates/{name}.weight/log10_ratio")
        median = statistics.median(e.value for e in series)
        print(f"{name + '.weight':14} {LR * scale:8.0e} {median:12.2f}   {verdict(median)}")
    print(f"({len(series)} logged steps, every 5 optimizer steps; healthy is about -3)\n")
    print(f"Where to look:  tensorboard --logdir {log_dir}")
    print("  Scalars tab, filter 'log10_ratio': one curve per parameter; the healthy band is -4 to -2.")


if __name__ == "__main__":
    main(*sys.argv[1:])
