"""Dead ReLUs: find the layer whose units never fire, from the logs ActivationMonitor writes.

A four-layer MLP where one layer was initialised badly (a bias of -4 puts its ReLU's input far
below zero, so the ReLU outputs 0 for every sample, passes no gradient, and never recovers).
The script trains it on CPU for a few seconds, reads ``zero_fraction`` per module back from
the TensorBoard event files, and prints which ReLUs are dead and where to look.

    python examples/dead_relu.py [log_dir]          # default: runs/dead_relu
    tensorboard --logdir runs/dead_relu
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

from lightning_hooks import ActivationMonitor

DEAD_ABOVE = 0.99  # a ReLU that outputs zero this often is dead


class MLP(L.LightningModule):
    def __init__(self, bad_layer: int = 2) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(),
            nn.Linear(64, 64), nn.ReLU(),
            nn.Linear(64, 64), nn.ReLU(),
            nn.Linear(64, 1),
        )
        with torch.no_grad():  # the bug: a bias far below the typical pre-activation
            self.net[bad_layer].bias.fill_(-4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def data(n: int = 2048) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    y = (x[:, :4] ** 2).sum(1, keepdim=True) - x[:, 4:8].sum(1, keepdim=True)
    return DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=gen)


def main(log_dir: str = "runs/dead_relu") -> None:
    quiet_lightning()
    L.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(log_dir, name="")  # a new version_<n> folder per run
    monitor = ActivationMonitor(log_every_n_steps=10, modules=[nn.ReLU, nn.Linear], stats=["zero_fraction", "max"])
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=3, logger=logger, callbacks=[monitor], log_every_n_steps=10,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    model = MLP()
    trainer.fit(model, data())
    logger.experiment.flush()

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    print(f"\nzero_fraction of each ReLU (share of outputs that are exactly 0), from {logger.log_dir}:")
    print(f"{'module':10} {'first step':>12} {'last step':>12}   verdict")
    relus = [name for name, module in model.named_modules() if isinstance(module, nn.ReLU)]
    dead = []
    for name in relus:
        series = events.Scalars(f"activations/{name}/zero_fraction")
        first, last = series[0].value, series[-1].value
        verdict = "DEAD" if last > DEAD_ABOVE else "ok"
        if verdict == "DEAD":
            dead.append(name)
        print(f"{name:10} {first:12.3f} {last:12.3f}   {verdict}")
    print(f"(steps {series[0].step} to {series[-1].step}, every 10 optimizer steps)")
    for name in dead:
        before = f"net.{int(name.split('.')[1]) - 1}"
        highest = max(e.value for e in events.Scalars(f"activations/{before}/max"))
        print(f"{before}, the Linear feeding {name}: largest output at any logged step {highest:.2f} (< 0)")
    print(f"\nDead ReLUs: {', '.join(dead) or 'none'}.")
    print("A dead ReLU's input is negative for every sample: look at the layer just before it")
    print("(its bias or weight init, or a learning rate that pushed it there).\n")
    print(f"Where to look:  tensorboard --logdir {log_dir}")
    print("  Scalars tab, filter 'zero_fraction': a dead ReLU's curve sits at 1.0 from the start.")
    print("  Histograms tab, activations/<relu>: a dead ReLU's histogram is one spike at 0, with")
    print("  max 0; a healthy one spreads over positive values. The Linear before it has all of")
    print("  its histogram below zero.")


if __name__ == "__main__":
    main(*sys.argv[1:])
