"""Run by tests/test_late_reads.py: 2-process CPU DDP (gloo), a check read a step late, one JSON file per rank.

A NaN on rank 1 only at step 3, ``action="stop"`` (read a step late) and a GradientMonitor beside
it: both ranks read each step's transfer at the next step, act at step 4 on step 3 and stop.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

import lightning as L

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks.callbacks.gradients import GradientMonitor  # noqa: E402
from lightning_hooks.callbacks.stopping import GradientAnomalyStopping  # noqa: E402
from lightning_hooks.distributed import _rank_agreement  # noqa: E402
from tests.grad_helpers import GradNet  # noqa: E402
from tests.helpers import leave_process_group, loader  # noqa: E402


class Transfers(L.Callback):
    """Where each of the step's transfers was started and read: (global step, or "end") pairs.

    ``patch`` sets the counting wrappers on ``HostTransfer``: ``setattr`` in a process of its own,
    pytest's ``monkeypatch.setattr`` in a test (undone after it).
    """

    def __init__(self, patch: Callable[[Any, str, Any], None] = setattr) -> None:
        self.now: Any = None
        self.started: dict[int, Any] = {}
        self.reads: list[tuple[Any, Any]] = []
        start, read = _rank_agreement.HostTransfer.__init__, _rank_agreement.HostTransfer.read

        def counted_start(transfer: Any, *args: Any, **kwargs: Any) -> None:
            self.started[id(transfer)] = self.now
            start(transfer, *args, **kwargs)

        def counted_read(transfer: Any, *args: Any, **kwargs: Any) -> Any:
            self.reads.append((self.started[id(transfer)], self.now))
            return read(transfer, *args, **kwargs)

        patch(_rank_agreement.HostTransfer, "__init__", counted_start)
        patch(_rank_agreement.HostTransfer, "read", counted_read)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.now = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.now = "end"


def main(out_dir: str) -> None:
    L.seed_everything(0, verbose=False)
    transfers = Transfers()
    stopper = GradientAnomalyStopping(action="stop", prog_bar=False)
    monitor = GradientMonitor(log_every_n_steps=50, prog_bar=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=20, logger=False,
        callbacks=[transfers, stopper, monitor], enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(GradNet(nan_steps=(3,), nan_rank=1), loader(n=128, batch_size=4))
    result = {"global_step": trainer.global_step, "report_step": stopper.last_report.step,
              "dropped_steps": stopper.dropped_steps, "monitor_anomalies": monitor.anomalous_steps,
              "reads": transfers.reads}
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
