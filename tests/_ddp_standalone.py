"""Run by tests/test_compat.py: 2-process CPU DDP (gloo) under the standalone ``pytorch_lightning``.

ActivationMonitor writes to TensorBoard; GradientAnomalyStopping stops both ranks when rank 1
alone turns NaN at step 3.
"""

from __future__ import annotations

import json
import os
import sys

import pytorch_lightning as ptl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks import ActivationMonitor, GradientAnomalyStopping  # noqa: E402
from tests.compat_helpers import StandaloneNet  # noqa: E402
from tests.helpers import forward_hook_count, leave_process_group, loader  # noqa: E402


def main(out_dir: str) -> None:
    ptl.seed_everything(0, verbose=False)
    model, stopper = StandaloneNet(nan_steps=(3,), nan_rank=1), GradientAnomalyStopping(provenance=True)
    trainer = ptl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=6, log_every_n_steps=2,
        logger=ptl.loggers.TensorBoardLogger(out_dir, name="", version=""),
        callbacks=[ActivationMonitor(), stopper],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(model, loader(n=128, batch_size=4))
    report = stopper.last_report
    result = {"global_step": trainer.global_step, "hooks_after": forward_hook_count(model),
              "report": [report.step, report.first_nonfinite_module, report.nonfinite_rank] if report else None}
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
