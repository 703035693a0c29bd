"""Run by tests/test_stopping.py: 2-process CPU DDP (gloo), two fits, one JSON file per rank.

``nan``: a NaN injected on rank 1 only, ``action="stop"`` with provenance.
``split``: rank 1 alone flags step 3 (a test-only subclass; its gradients are the same as rank
0's), ``action="skip"``, and alone is unsure at step 2 whether its gradients are finite (as
when a norm overflows); what each check asks of the host and of the other rank is counted, for
the stopper and for a GradientMonitor beside it, which reads the same measurement.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from contextlib import ExitStack
from typing import Any
from unittest import mock

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks.callbacks.gradients import GradientMonitor  # noqa: E402
from lightning_hooks.callbacks.stopping import GradientAnomalyStopping  # noqa: E402
from lightning_hooks.distributed import _shared_measurement  # noqa: E402
from lightning_hooks.distributed._step_measure import Step, measure_step  # noqa: E402
from tests.grad_helpers import GradNet  # noqa: E402
from tests.helpers import counted, leave_process_group, loader  # noqa: E402

COUNTED = ((torch.distributed, "all_reduce"), (torch.distributed, "barrier"), (torch.Tensor, "cpu"))


class RankOneFlagsStep3(GradientAnomalyStopping):
    """Rank 1 alone is unsure at step 2 and flags step 3; counts collectives and host transfers per step."""

    def __init__(self) -> None:
        super().__init__(action="skip", prog_bar=False)
        self.calls: dict[int, Counter] = {}

    @staticmethod
    def _measure_step(trainer: L.Trainer, optimizer: Any, detectors: Any, shard_groups: Any, exact: bool) -> list[Step]:
        steps = measure_step(trainer, optimizer, detectors, shard_groups, exact)
        for step in steps:
            if trainer.global_rank == 1 and trainer.global_step == 3:
                step.flags = torch.ones_like(step.flags)
            if trainer.global_rank == 1 and trainer.global_step == 2 and not exact:
                step.unsure = torch.ones_like(step.unsure)
        return steps

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        calls = self.calls.setdefault(trainer.global_step, Counter())
        with ExitStack() as stack:
            for obj, name in (*COUNTED, (trainer.strategy, "reduce_boolean_decision")):
                stack.enter_context(counted(obj, name, calls))
            stack.enter_context(mock.patch.object(_shared_measurement, "measure_step", self._measure_step))
            super().on_before_optimizer_step(trainer, pl_module, optimizer)


class CountedMonitor(GradientMonitor):
    """A GradientMonitor beside the stopper, counting what its own step hook asks of the host and the other rank."""

    def __init__(self) -> None:
        super().__init__(log_every_n_steps=2, prog_bar=False)
        self.calls: dict[int, Counter] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        calls = self.calls.setdefault(trainer.global_step, Counter())
        with ExitStack() as stack:
            for obj, name in COUNTED:
                stack.enter_context(counted(obj, name, calls))
            super().on_before_optimizer_step(trainer, pl_module, optimizer)


class Snapshots(L.Callback):
    def __init__(self) -> None:
        self.params: dict[int, list[float]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.params[trainer.global_step] = flat_params(pl_module)


def flat_params(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def fit(callbacks: list[L.Callback], model: GradNet) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(model, loader(n=128, batch_size=4))
    return trainer


def main(out_dir: str) -> None:
    L.seed_everything(0, verbose=False)
    stopper = GradientAnomalyStopping(provenance=True)
    trainer = fit([stopper], GradNet(nan_steps=(3,), nan_rank=1))
    report = stopper.last_report
    nan = {
        "global_step": trainer.global_step,
        "report_step": report.step if report else None,
        "module": report.first_nonfinite_module if report else None,
        "nonfinite_rank": report.nonfinite_rank if report else None,
        "first_bad_param": report.nonfinite_params[0] if report else None,
    }
    split, snapshots, model, monitor = RankOneFlagsStep3(), Snapshots(), GradNet(), CountedMonitor()
    trainer = fit([snapshots, split, monitor], model)
    result = {
        "nan": nan,
        "split": {
            "global_step": trainer.global_step,
            "report_step": split.last_report.step if split.last_report else None,
            "dropped_steps": split.dropped_steps,
            "step3_applied": snapshots.params[3] != snapshots.params[4],
            "step4_applied": snapshots.params[4] != snapshots.params[5],
            "params": flat_params(model),
            "calls": {step: dict(calls) for step, calls in split.calls.items()},
            "monitor_calls": {step: dict(calls) for step, calls in monitor.calls.items()},
        },
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
