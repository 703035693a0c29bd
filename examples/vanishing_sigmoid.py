"""A deep stack of sigmoids: the gradients of the first layers vanish, and are flagged.

Twelve Linear + Sigmoid layers, their parameters in three optimizer parameter groups (layers
0-3, 4-7, 8-11). GradientMonitor logs one gradient norm per layer (``granularity="module"``)
and flags a parameter group whose norm falls below ``min_norm``: the first group is flagged
``anomalies/vanishing/group0``, while the total norm, dominated by the last layers, looks
healthy. CPU only, a few seconds, no downloads. TensorBoard logs go under
``./runs/vanishing_sigmoid`` (or the directory given as the first argument).

    python examples/vanishing_sigmoid.py
"""

from __future__ import annotations

import math
import sys

import lightning as L
import torch
from _quiet import quiet_lightning  # Lightning's own noise, silenced by message (see _quiet.py)
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradientMonitor

DEPTH, WIDTH, MIN_NORM = 12, 32, 1e-5


class DeepSigmoid(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Sigmoid()]
        self.net = nn.Sequential(*layers, nn.Linear(WIDTH, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        linears = [m for m in self.net if isinstance(m, nn.Linear)]
        thirds = [linears[0:4], linears[4:8], linears[8:]]
        groups = [{"params": [p for m in third for p in m.parameters()]} for third in thirds]
        return torch.optim.SGD(groups, lr=0.1)


def data(n: int = 512) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, WIDTH, generator=gen)
    return DataLoader(TensorDataset(x, x[:, :1].sign()), batch_size=32)


def main(log_dir: str = "runs/vanishing_sigmoid") -> None:
    quiet_lightning()
    L.seed_everything(0, verbose=False)
    monitor = GradientMonitor(log_every_n_steps=8, granularity="module", modules=nn.Linear, min_norm=MIN_NORM)
    logger = TensorBoardLogger(log_dir, name="")  # a new version_<n> folder per run
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=2, logger=logger, callbacks=[monitor], log_every_n_steps=8,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    trainer.fit(DeepSigmoid(), data())
    logger.experiment.flush()

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()

    def last(tag: str) -> float:
        return events.Scalars(tag)[-1].value

    step = events.Scalars("gradients/total_norm")[-1].step
    print(f"\nGradient norm per Linear layer at step {step} (bars: log scale, one # per decade):")
    for index in range(DEPTH + 1):
        norm = last(f"gradients/net.{2 * index}/norm")
        print(f"  net.{2 * index:<3d} {norm:10.3g}  {'#' * max(0, int(12 + math.log10(norm)))}")
    print(f"total norm {last('gradients/total_norm'):.3g}; per group: "
          + ", ".join(f"{last(f'gradients/total_norm/group{g}'):.3g}" for g in range(3)))
    steps = len(events.Scalars("anomalies/vanishing"))
    for tag in ("anomalies/vanishing", *(f"anomalies/vanishing/group{g}" for g in range(3))):
        flagged = sum(e.value for e in events.Scalars(tag))
        print(f"{tag:30s} flagged on {flagged:3.0f} of {steps} steps (min_norm={MIN_NORM:g})")
    print(f"\nThe last report (one per run of flagged steps, or a new flag):\n{monitor.last_report}")


if __name__ == "__main__":
    main(*sys.argv[1:])
