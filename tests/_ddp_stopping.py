"""Run by tests/test_stopping.py: 2-process CPU DDP (gloo), a NaN injected on rank 1 only."""

from __future__ import annotations

import json
import os
import sys

import lightning as L

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks.stopping import GradientAnomalyStopping  # noqa: E402
from tests.grad_helpers import GradNet  # noqa: E402
from tests.helpers import loader  # noqa: E402


def main(out_dir: str) -> None:
    L.seed_everything(0, verbose=False)
    stopper = GradientAnomalyStopping(provenance=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=20, logger=False, callbacks=[stopper],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(GradNet(nan_steps=(3,), nan_rank=1), loader(n=128, batch_size=4))
    report = stopper.last_report
    result = {
        "global_step": trainer.global_step,
        "report_step": report.step if report else None,
        "module": report.first_nonfinite_module if report else None,
        "nonfinite_rank": report.nonfinite_rank if report else None,
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
