"""Run by tests/test_ddp.py: a 2-process CPU DDP fit with ActivationMonitor (gloo), activation gradients too.

With a LayerHealth, whose prediction-layer pull rank zero takes and logs in the monitor's transfer.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks import STAT_NAMES, ActivationMonitor, LayerHealth  # noqa: E402
from lightning_hooks.callbacks._loss_pull import own_parameters, pull  # noqa: E402
from tests.helpers import TinyNet, forward_hook_count, leave_process_group, loader  # noqa: E402


class RecordLocal(L.Callback):
    """Each rank notes the hooks it carries during fit and saves its own batch of step 0."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.hooks_during = -1
        self.pulls: dict[int, float] = {}  # by global step: the prediction layer's pull, as this rank sees it

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.pulls[trainer.global_step] = pull(own_parameters(pl_module, "net.2")).item()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.hooks_during = max(self.hooks_during, forward_hook_count(pl_module))  # on at logged steps only
        if trainer.global_step == 0:
            torch.save(batch[0], os.path.join(self.out_dir, f"batch0-rank{trainer.global_rank}.pt"))


def main(out_dir: str) -> None:
    L.seed_everything(0, verbose=False)
    model = TinyNet()
    torch.save(model.state_dict(), os.path.join(out_dir, "initial.pt"))
    record = RecordLocal(out_dir)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=3, log_every_n_steps=2,
        logger=TensorBoardLogger(out_dir, name="", version=""),
        callbacks=[ActivationMonitor(stats=STAT_NAMES, gradients=True), LayerHealth(max_images=1), record],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(model, loader(n=64, batch_size=4))
    result = {"rank": trainer.global_rank, "hooks_during": record.hooks_during,
              "hooks_after": forward_hook_count(model), "global_step": trainer.global_step, "pulls": record.pulls}
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
