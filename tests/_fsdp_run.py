"""Run by tests/test_sharded.py: one fit, sharded on 2 CPU processes (gloo), or whole on one.

``python _fsdp_run.py OUT MODE [devices] [kind]``, where ``kind`` is how 2 devices shard:

``fsdp2`` (the default): ``fully_shard`` through Lightning's ``ModelParallelStrategy``
(DTensor gradients). ``fsdp1``: Lightning's ``FSDPStrategy`` (``FullyShardedDataParallel``
around each Linear and the whole model, ``use_orig_params=True``: flat 1-D shards), let onto
the CPU by :class:`CPUFSDPStrategy`. ``tp``: tensor parallelism through ``ModelParallelStrategy``
(``parallelize_module``: the Linears split by columns or rows over 2 ranks, every rank on the
whole batch; DTensor gradients sharded on dim 0 or 1, or replicated, and the PReLU plain).

``figures``: GradientTransform (scale, clip_norm) then GradientMonitor (every stat, histograms)
and ActivationMonitor, every step logged to TensorBoard under OUT. With 2 devices each rank
trains on its half of the batch; with 1 device the model runs whole on the global batch, as
the reference.
``nan``: 2 devices; rank 1 alone feeds a NaN at step 2; GradientAnomalyStopping skips it;
GradientMonitor logs update ratios.
``stop``: the same, and the stop action.
``unused``: no NaN, and a ``spare`` Linear the forward never calls; GradientMonitor and
GradientAnomalyStopping (skip) check every step.
Each rank writes ``rank<r>.json``: the steps it took, its skipped steps, and the final parameters.
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
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks import (  # noqa: E402
    GRADIENT_STAT_NAMES,
    STAT_NAMES,
    ActivationMonitor,
    GradientAnomalyStopping,
    GradientMonitor,
    GradientTransform,
)
from lightning_hooks.measure._sharding import local  # noqa: E402
from tests.helpers import counted, leave_process_group, loader  # noqa: E402

NAN_STEP = 2


class ShardedNet(L.LightningModule):
    """Linear(8, 16) -> PReLU(16) -> Linear(16, 6) -> Linear(6, 1), each Linear sharded when there is a mesh.

    The PReLU's weight is sharded with the whole model: under FSDP1 it belongs to the root unit,
    which wraps the LightningModule.
    """

    def __init__(self, nan_rank: int = -1, spare: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.PReLU(16), nn.Linear(16, 6), nn.Linear(6, 1))
        self.nan_rank = nan_rank
        if spare:
            self.spare = nn.Linear(3, 1)  # never called: no gradient

    def configure_model(self) -> None:
        if self.device_mesh is None:
            return
        if self.device_mesh["tensor_parallel"].size() > 1:
            plan = {"0": ColwiseParallel(output_layouts=Replicate()), "2": ColwiseParallel(), "3": RowwiseParallel()}
            parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)
            return
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_step == NAN_STEP and self.global_rank == self.nan_rank:
            x = x * float("nan")
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        """Rank r of 2 takes every other sample from r on, 8 a batch: step by step, the 16 one process takes.

        Under tensor parallelism (no data parallelism) every rank takes the 16.
        """
        data = loader(n=64).dataset
        mesh = self.device_mesh
        if self.trainer.world_size == 1 or (mesh is not None and mesh["data_parallel"].size() == 1):
            return DataLoader(data, batch_size=16)
        return DataLoader(Subset(data, range(self.global_rank, len(data), 2)), batch_size=8)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on CPU processes, for tests (gloo).

    Lightning refuses the CPU for ``FSDPStrategy`` itself (not for a subclass), and hands FSDP1
    no device there, which it needs: this wraps the model with ``device_id=cpu`` and leaves
    the rest of the setup to Lightning, which takes a wrapped model as it is.
    """

    def _setup_model(self, model: nn.Module) -> nn.Module:
        policy = self.kwargs.pop("auto_wrap_policy")
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), auto_wrap_policy=policy, **self.kwargs)
        return super()._setup_model(model)


class Counting:
    """Counts the collectives and host transfers of each step's check, made in this callback's hook."""

    calls: dict[int, Counter]

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        calls = self.calls.setdefault(trainer.global_step, Counter())
        with ExitStack() as stack:
            for obj, name in ((torch.distributed, "all_reduce"), (torch.distributed, "all_gather"),
                              (torch.Tensor, "cpu")):
                stack.enter_context(counted(obj, name, calls))
            super().on_before_optimizer_step(trainer, pl_module, optimizer)  # type: ignore[misc]


class CountedStopping(Counting, GradientAnomalyStopping):
    def __init__(self, action: str) -> None:
        super().__init__(action=action, provenance=True, prog_bar=False)
        self.calls = {}


class CountedMonitor(Counting, GradientMonitor):
    def __init__(self) -> None:
        super().__init__(stats=(), update_ratio=True)
        self.calls = {}


class Record(L.Callback):
    """Notes the steps taken and, at the end, every parameter whole."""

    def __init__(self, out: str) -> None:
        self.out, self.steps = out, []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.steps.append(trainer.global_step)

    def on_fit_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        with ExitStack() as stack:
            if isinstance(trainer.model, FullyShardedDataParallel):  # FSDP1: gather the whole parameters
                stack.enter_context(FullyShardedDataParallel.summon_full_params(trainer.model, writeback=False))
            params = {
                _name(name): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1).tolist()
                for name, p in pl_module.named_parameters()
            }
        stopping = [c for c in trainer.callbacks if isinstance(c, CountedStopping)]
        monitor = [c for c in trainer.callbacks if isinstance(c, CountedMonitor)]
        record = {"steps": self.steps, "params": params, "global_step": trainer.global_step,
                  "local_shapes": {_name(n): list(local(p).shape) for n, p in pl_module.named_parameters()},
                  "calls": {step: dict(c) for step, c in stopping[0].calls.items()} if stopping else {},
                  "monitor_calls": {step: dict(c) for step, c in monitor[0].calls.items()} if monitor else {},
                  "report": str(stopping[0].last_report) if stopping else None}
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


def _name(name: str) -> str:
    """A parameter's name in the model as written (FSDP1 puts its wrappers into the names)."""
    return name.replace("._fsdp_wrapped_module", "")


def main(out: str, mode: str, devices: int, kind: str) -> None:
    sharded = devices > 1
    callbacks: list[L.Callback] = [Record(out)]
    if mode == "figures":
        callbacks += [
            GradientTransform(scale={"net.0": 0.5, "net.1": 2.0}, clip_norm={"net.2": 0.05}),
            GradientMonitor(stats=GRADIENT_STAT_NAMES, norm_threshold=1e6, update_ratio=True),
            ActivationMonitor(stats=STAT_NAMES),
        ]
    else:
        callbacks.append(CountedStopping(action="stop" if mode == "stop" else "skip"))
    if mode == "unused":
        callbacks.append(GradientMonitor(norm_threshold=1e6))
    if mode == "nan":
        callbacks.append(CountedMonitor())
    strategy: Any = "auto"
    if sharded:
        strategy = {"fsdp2": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                    "tp": lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
                    "fsdp1": lambda: CPUFSDPStrategy(auto_wrap_policy={nn.Linear})}[kind]()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, log_every_n_steps=1,
        logger=TensorBoardLogger(out, name="", version=""), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    trainer.fit(ShardedNet(nan_rank=1 if mode in ("nan", "stop") else -1, spare=mode == "unused"))
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2,
         sys.argv[4] if len(sys.argv) > 4 else "fsdp2")
