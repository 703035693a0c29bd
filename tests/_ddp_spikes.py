"""Run by tests/test_spikes.py: 2-process CPU DDP (gloo), two fits with GradientAnomalyStopping(spikes=...).

First the loss x1000 on rank 1 only at step 40, with ``SpikeTrigger(grad_norm=None)``: only
rank 1 sees the spike, so both ranks must flag it and roll back at the same step through the
flags summed in the step's one collective; a flight recorder keeps 16 steps, and what the
stopper's hooks ask of the host and of the other rank is counted per step. Then the gradient
norm alone, with ``net.0``'s gradients ramping up from step 40: both ranks flag it, and their
flight records name ``net.0``. Each rank writes what it saw to ``rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from contextlib import ExitStack
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks import GradientAnomalyStopping, SpikeTrigger  # noqa: E402
from tests.grad_helpers import GradNet  # noqa: E402
from tests.helpers import counted, leave_process_group, loader  # noqa: E402

SPIKE = 40


class RankSpikeNet(GradNet):
    """GradNet whose loss is multiplied by 1000 at step ``SPIKE`` on rank 1 only."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 1000.0 if self.global_step == SPIKE and self.trainer.global_rank == 1 else loss


COUNTED = ((torch.distributed, "all_reduce"), (torch.distributed, "barrier"), (torch.Tensor, "cpu"),
           (torch.Tensor, "item"), (torch.Tensor, "tolist"))


class CountedStopper(GradientAnomalyStopping):
    """Counts the collectives and host transfers of its backward and step hooks, per step."""

    calls: dict[int, Counter]

    def on_before_backward(self, trainer: L.Trainer, pl_module: Any, loss: torch.Tensor) -> None:
        self._counted(trainer, super().on_before_backward, trainer, pl_module, loss)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self._counted(trainer, super().on_before_optimizer_step, trainer, pl_module, optimizer)

    def _counted(self, trainer: L.Trainer, hook: Any, *args: Any) -> None:
        calls = self.calls.setdefault(trainer.global_step, Counter())
        with ExitStack() as stack:
            for obj, name in COUNTED:
                stack.enter_context(counted(obj, name, calls))
            hook(*args)


class Probe(L.Callback):
    """After the stopper: the steps that rolled back."""

    def __init__(self, stopper: GradientAnomalyStopping) -> None:
        self.stopper, self.rolled_back = stopper, []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.stopper.rollbacks > len(self.rolled_back):
            self.rolled_back.append(self.stopper.last_rollback[0])  # the step acted on (read a step late)


class RampNet(GradNet):
    """GradNet whose ``net.0`` gradients are multiplied by 3, 9, 27, ... from step ``SPIKE``: that layer leads."""

    def on_fit_start(self) -> None:
        self.net[0].weight.register_hook(lambda g: g * 3.0 ** (self.global_step - SPIKE + 1)
                                         if self.global_step >= SPIKE else g)


def grad_norm_fit(out_dir: str) -> dict[str, Any]:
    """A second fit: the gradient norm alone is watched, and ``net.0``'s gradients ramp up from step ``SPIKE``."""
    L.seed_everything(0, verbose=False)
    stopper = GradientAnomalyStopping(action="skip", prog_bar=False, flight_recorder=16,
                                      spikes=SpikeTrigger(loss=None, window=32, warmup=24))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=44, logger=False, default_root_dir=out_dir,
        callbacks=[stopper], enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(RampNet(), loader(n=44 * 8 * 2, batch_size=8))
    report = stopper.last_report
    return {"flags": list(report.flags), "step": report.step, "leader": report.flight_record.leader,
            "dropped_steps": stopper.dropped_steps}


def main(out_dir: str) -> None:
    L.seed_everything(0, verbose=False)
    stopper = CountedStopper(
        action="rollback", rollback_every_n_steps=5, skip_batches=1, prog_bar=False,
        spikes=SpikeTrigger(grad_norm=None, window=32, warmup=24), flight_recorder=16,
    )
    stopper.calls = {}
    probe = Probe(stopper)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=46, logger=False, default_root_dir=out_dir,
        callbacks=[stopper, probe], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(RankSpikeNet(), loader(n=46 * 8 * 2, batch_size=8))
    report = stopper.last_report
    record = report.flight_record if report else None
    result = {
        "flags": list(report.flags) if report else None, "report_step": report.step if report else None,
        "rolled_back": probe.rolled_back, "leader": record.leader if record else None,
        "record_path": record.path if record else None,
        "record_exists": bool(record and record.path and os.path.exists(record.path)),
        "calls": {step: dict(calls) for step, calls in stopper.calls.items()},
        "params": torch.cat([p.detach().flatten() for p in trainer.lightning_module.parameters()]).tolist(),
        "grad_norm": grad_norm_fit(out_dir),
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
