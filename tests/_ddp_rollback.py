"""Run by tests/test_rollback.py: 2-process CPU DDP (gloo), a NaN on rank 1 at step 4, action="rollback".

Snapshots before steps 0 and 3 (``rollback_every_n_steps=3``); step 4 is rolled back and step
5 skipped (``skip_batches=1``). A GradientMonitor with ``update_ratio=True`` and a LayerHealth
run beside it.
Each rank writes what it saw to ``rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks import GradientAnomalyStopping, GradientMonitor, LayerHealth  # noqa: E402
from tests.grad_helpers import GradNet  # noqa: E402
from tests.helpers import csv_metrics, leave_process_group, loader  # noqa: E402


class Probe(L.Callback):
    """After the stopper: the parameters at each step's start, and the steps that rolled back."""

    def __init__(self, stopper: GradientAnomalyStopping) -> None:
        self.stopper, self.params, self.rolled_back_at = stopper, {}, []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.params[trainer.global_step] = flat_params(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.stopper.rollbacks > len(self.rolled_back_at):
            self.rolled_back_at.append(trainer.global_step - 1)


def flat_params(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def main(out_dir: str) -> None:
    L.seed_everything(0, verbose=False)
    stopper = GradientAnomalyStopping(action="rollback", rollback_every_n_steps=3, skip_batches=1, prog_bar=False)
    probe, model, health = Probe(stopper), GradNet(nan_steps=(4,), nan_rank=1), LayerHealth()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=8, log_every_n_steps=1,
        logger=[CSVLogger(out_dir, name="", version=""), TensorBoardLogger(out_dir, name="tb")],
        callbacks=[GradientMonitor(update_ratio=True, prog_bar=False), stopper, probe, health],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(model, loader(n=128, batch_size=4))
    trainer.strategy.barrier()  # rank zero's metrics.csv is complete
    ratios = {int(r["step"]) for r in csv_metrics(out_dir) if r.get("updates/net.0.weight/ratio", "")}
    params = flat_params(model)
    result = {
        "rolled_back_at": probe.rolled_back_at, "restored": probe.params[5] == probe.params[3],
        "global_step": trainer.global_step, "dropped_steps": stopper.dropped_steps,
        "finite": bool(torch.isfinite(torch.tensor(params)).all()), "params": params,
        "ratio_steps": sorted(ratios), "health_images": health._images,
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
