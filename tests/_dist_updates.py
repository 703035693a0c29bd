"""Run by tests/test_updates_distributed.py: UpdateTransform on 2 CPU processes (gloo), or whole on one.

``python _dist_updates.py OUT KIND DEVICES``: ``KIND`` is ``ddp``, ``fsdp2`` (``fully_shard``
through ``ModelParallelStrategy``) or ``fsdp1`` (``FSDPStrategy``, flat shards); with 1 device the
model trains whole on the global batch, the reference. tests/_fsdp_run.py's ShardedNet under AdamW,
8 steps, with every transform: a scale, a ratio cap that binds, a history clip that binds.
Each rank writes ``rank<r>.json`` (the parameters whole, through _fsdp_run's Record) and
``updates<r>.json``: the history of norms, and the collectives each step's rewrite made.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks import UpdateTransform  # noqa: E402
from tests._fsdp_run import CPUFSDPStrategy, Record, ShardedNet  # noqa: E402
from tests.helpers import counted, leave_process_group  # noqa: E402

TRANSFORM = dict(scale={"net.0": 0.5}, max_ratio={"net.2": 0.02}, clip_to_history="*",
                 history_window=4, history_sigmas=0.5)


class AdamNet(ShardedNet):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


class CountedUpdates(UpdateTransform):
    """Counts the collectives of each step's rewrite; writes the history at the end."""

    def __init__(self, out: str) -> None:
        super().__init__(**TRANSFORM)
        self.out, self.calls = out, []
        rewrite = self._rewrite.after_step

        def after_step(*args: Any) -> None:
            calls: Counter = Counter()
            with counted(torch.distributed, "all_reduce", calls), counted(torch.Tensor, "cpu", calls):
                rewrite(*args)
            self.calls.append(dict(calls))

        self._rewrite.after_step = after_step  # type: ignore[method-assign]

    def on_fit_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        norms = self._rewrite.histories[0].norms
        record = {"calls": self.calls, "norms": norms.tolist() if norms is not None else None}
        with open(os.path.join(self.out, f"updates{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)
        super().on_fit_end(trainer, pl_module)


def main(out: str, kind: str, devices: int) -> None:
    strategy: Any = "auto"
    if devices > 1:
        strategy = {"ddp": lambda: DDPStrategy(),
                    "fsdp2": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                    "fsdp1": lambda: CPUFSDPStrategy(auto_wrap_policy={nn.Linear})}[kind]()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=8, logger=False,
        callbacks=[CountedUpdates(out), Record(out)], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
    )
    trainer.fit(AdamNet())
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
