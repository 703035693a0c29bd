"""Loss spike: roll back to the last good state and skip the bad batches, instead of diverging.

A small regression MLP trained with SGD, where one batch of the data is corrupt (its inputs
and targets scaled by 1e3, as a broken shard would be). Without protection its update blows
the weights up and the run never recovers. With
``GradientAnomalyStopping(action="rollback", rollback_every_n_steps=10, skip_batches=3)`` the
exploding gradient is caught before the update, the model, optimizer and LR scheduler go back
to the snapshot taken at most 10 clean steps earlier, the next 3 batches are passed over, and
training goes on. The script runs both and prints what happened.

    python examples/loss_spike_rollback.py [log_dir]          # default: runs/loss_spike_rollback
    tensorboard --logdir runs/loss_spike_rollback
"""

from __future__ import annotations

import sys
from typing import Optional

import lightning as L
import torch
from _quiet import quiet_lightning  # Lightning's own noise, silenced by message (see _quiet.py)
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradientAnomalyStopping

BATCH, STEPS, BAD_STEP = 32, 120, 45


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def data() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 8, generator=gen)
    x[BAD_STEP * BATCH : (BAD_STEP + 1) * BATCH] *= 1e3  # the corrupt batch
    return DataLoader(TensorDataset(x, x[:, :4].sum(1, keepdim=True)), batch_size=BATCH)


def train(log_dir: str, name: str, stopper: Optional[GradientAnomalyStopping]) -> tuple[MLP, float]:
    L.seed_everything(0, verbose=False)
    model = MLP()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=STEPS, logger=TensorBoardLogger(log_dir, name=name), log_every_n_steps=5,
        callbacks=[stopper] if stopper else [], enable_checkpointing=False, enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, data())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=gen)
    with torch.no_grad():
        loss = nn.functional.mse_loss(model.net(x), x[:, :4].sum(1, keepdim=True)).item()
    return model, loss


def main(log_dir: str = "runs/loss_spike_rollback") -> None:
    quiet_lightning()
    plain, plain_loss = train(log_dir, "unprotected", None)
    stopper = GradientAnomalyStopping(action="rollback", norm_threshold=1e3, rollback_every_n_steps=10, skip_batches=3)
    guarded, guarded_loss = train(log_dir, "rollback", stopper)
    finite = {name: all(torch.isfinite(p).all().item() for p in m.parameters()) for name, m in
              (("unprotected", plain), ("rollback", guarded))}
    print(f"\nA corrupt batch (inputs x1e3) at step {BAD_STEP} of {STEPS}:")
    print(f"  unprotected:  held-out loss {plain_loss:.3g}, parameters finite: {finite['unprotected']}")
    print(f"  rollback:     held-out loss {guarded_loss:.3g}, parameters finite: {finite['rollback']}")
    report = stopper.last_report
    print(f"Flagged at step {report.step if report else None}: {', '.join(report.flags) if report else '-'}"
          f" (total gradient norm {report.total_norm:.3g})" if report else "Nothing flagged")
    step, to = stopper.last_rollback or (None, None)
    print(f"Rolled back {stopper.rollbacks} time(s): step {step} went back to the state before step {to};"
          f" updates dropped: {stopper.dropped_steps} (the bad step and the 3 batches after it)")
    print("The global step kept counting; the LR schedule went back with the model and was held over the"
          " skipped batches.\n")
    print(f"Where to look:  tensorboard --logdir {log_dir}")
    print("  Scalars tab, train_loss: 'unprotected' jumps at the bad step and never comes back;")
    print("  'rollback' carries on. Text tab: anomalies/report, the report of the flagged step.")


if __name__ == "__main__":
    main(*sys.argv[1:])
