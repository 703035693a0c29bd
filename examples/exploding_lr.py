"""A learning rate far too big: the gradients explode, the run is stopped at that step.

GradientMonitor logs gradient norms and anomaly flags; GradientAnomalyStopping stops the run
after ``patience`` exploding steps in a row, drops the last bad update and prints its report.
CPU only, a few seconds, no downloads. TensorBoard logs go under ``./runs/exploding_lr`` (or
the directory given as the first argument).

    python examples/exploding_lr.py
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

from lightning_hooks import GradientAnomalyStopping, GradientMonitor

MAX_NORM = 1e3


class Regressor(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 1))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def data(n: int = 1024) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    return DataLoader(TensorDataset(x, x @ torch.randn(16, 1, generator=gen)), batch_size=32)


def main(log_dir: str = "runs/exploding_lr") -> None:
    quiet_lightning()
    L.seed_everything(0, verbose=False)
    monitor = GradientMonitor(log_every_n_steps=1, norm_threshold=MAX_NORM, histogram=False)
    stopper = GradientAnomalyStopping(action="stop", patience=2, norm_threshold=MAX_NORM, provenance=True)
    logger = TensorBoardLogger(log_dir, name="")  # a new version_<n> folder per run
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=5, logger=logger, callbacks=[monitor, stopper], log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    model = Regressor(lr=0.15)  # stable below about 0.05
    trainer.fit(model, data())
    logger.experiment.flush()

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    norms = {e.step: e.value for e in events.Scalars("gradients/total_norm")}
    flags = {name: {e.step: e.value for e in events.Scalars(f"anomalies/{name}")}
             for name in ("exploding", "nonfinite")}
    print(f"\nstep  total gradient norm  flag (norm_threshold={MAX_NORM:g})")
    for step in sorted(norms):
        fired = [name for name, values in flags.items() if values[step]]
        print(f"{step:4d}  {norms[step]:19.4g}  {', '.join(fired)}")
    report = stopper.last_report
    print(f"\nSteps count from 0. The anomaly at step {report.step} (the report above, printed by the callback"
          f" as it acted) was the third in a row (patience=2), so training stopped after it: steps 0-{report.step}"
          f" ran, so trainer.global_step (steps counted) is {trainer.global_step}, of {5 * len(data())} planned.")
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(f"Parameters all finite after the stop (the last, NaN update was dropped): {finite}")

if __name__ == "__main__":
    main(*sys.argv[1:])
