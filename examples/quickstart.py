"""Quick start: train a small classifier on CPU with lightning_hooks watching it.

Runs in well under a minute, writes TensorBoard logs under ``./runs/quickstart`` (or the
directory given as the first argument), and prints a few figures read back from them.

    python examples/quickstart.py
    tensorboard --logdir runs/quickstart   # LAYERS tab: every layer's figures as heatmaps
                                           # Histograms and Custom Scalars tabs: the same figures
"""

from __future__ import annotations

import sys

import lightning as L
import torch
from _quiet import quiet_lightning  # Lightning's own noise, silenced by message (see _quiet.py)
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_hooks as lh


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def synthetic_data(n: int = 4096) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 20, generator=gen)
    y = (x[:, :4].argmax(1)).long()  # a learnable rule
    return DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=gen)


def callbacks() -> list[L.Callback]:
    """The monitors this demo runs; every one of them is a plain Lightning callback."""
    return [
        lh.ActivationMonitor(log_every_n_steps=20),
        lh.GradientMonitor(log_every_n_steps=20, provenance=True),
        lh.GradientAnomalyStopping(action="skip", norm_threshold=1e4),
    ]


def main(log_dir: str = "runs/quickstart") -> None:
    quiet_lightning()
    L.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(log_dir, name="")  # a new version_<n> folder per run
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=2, logger=logger, callbacks=callbacks(),
        log_every_n_steps=20, enable_checkpointing=False, enable_model_summary=False,
    )
    trainer.fit(Classifier(), synthetic_data())
    logger.experiment.flush()

    events = EventAccumulator(logger.log_dir, size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    print(f"\nTensorBoard logs: {logger.log_dir}")
    print(f"{len(tags['histograms'])} histogram series, {len(tags['scalars'])} scalar series")
    for tag in ("activations/encoder.1/zero_fraction", "activations/head/std", "gradients/total_norm"):
        if tag in tags["scalars"]:
            first, last = events.Scalars(tag)[0], events.Scalars(tag)[-1]
            print(f"{tag}: step {first.step} -> {first.value:.3f}, step {last.step} -> {last.value:.3f}")
    print(f"Hooks left on the model after fit: {sum(len(m._forward_hooks) for m in trainer.model.modules())}")
    print(f"Look: tensorboard --logdir {log_dir}   (then the LAYERS tab)")


if __name__ == "__main__":
    main(*sys.argv[1:])
