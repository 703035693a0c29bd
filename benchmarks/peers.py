"""The tools people use instead, as callbacks the harness can run: a naive monitor, ``wandb.watch``.

(``Trainer(detect_anomaly=True)`` needs no callback: its configuration sets a Trainer argument.)

``TRANSFER_OWNERS`` tells the host-transfer counter which peer code to count, and whom to charge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_hooks.core.selection import select_modules

# Module-name prefix -> the owner its host transfers are charged to (None: the callback on the stack).
TRANSFER_OWNERS: dict[str, Optional[str]] = {__name__: None, "wandb": "wandb.watch"}


class NaiveHistogramMonitor(Callback):
    """The pattern of older monitors (e.g. Lightning Bolts' ``ModuleDataMonitor``).

    A forward hook on each module (the same modules ActivationMonitor picks by default) copies the
    output to the host with ``.cpu()``, histograms it with numpy and writes it to TensorBoard, on
    every logged step: one device-to-host copy per module per step, and the statistics on the CPU.
    """

    def __init__(self, log_every_n_steps: int = 1, bins: int = 64) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.bins = bins
        self._handles: list[Any] = []
        self._active = False
        self._step = 0
        self._writer: Any = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._writer = getattr(trainer.logger, "experiment", None)
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in select_modules(pl_module, None)]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if not self._active or self._writer is None:
                return
            values = output.detach().cpu().numpy()
            counts, edges = np.histogram(values, bins=self.bins)
            self._writer.add_histogram_raw(
                f"naive/{name}", min=float(values.min()), max=float(values.max()), num=int(values.size),
                sum=float(values.sum()), sum_squares=float(np.square(values, dtype=np.float64).sum()),
                bucket_limits=edges[1:].tolist(), bucket_counts=counts.tolist(), global_step=self._step,
            )
            self._writer.add_scalar(f"naive/{name}/std", float(values.std()), self._step)
        return hook

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step = trainer.global_step
        self._active = self._step % self.log_every_n_steps == 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._active = False

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


_WANDB_RUN: Any = None


def _wandb_run(tmp: str) -> Any:
    """One offline wandb run for the whole benchmark (started lazily, finished by ``finish_wandb``)."""
    global _WANDB_RUN
    if _WANDB_RUN is None:
        import wandb

        try:  # no system-metrics sampling: it would load the machine under every config alike
            settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True,
                                      x_disable_machine_info=True)
        except Exception:  # older wandb: other names for those settings
            settings = wandb.Settings(console="off", silent=True)
        _WANDB_RUN = wandb.init(project="lightning-hooks-bench", mode="offline", dir=tmp, settings=settings)
    return _WANDB_RUN


def finish_wandb() -> None:
    """Finish the benchmark's wandb run, if one was started."""
    global _WANDB_RUN
    if _WANDB_RUN is not None:
        _WANDB_RUN.finish()
        _WANDB_RUN = None


class WandbWatch(Callback):
    """``wandb.watch(model, log="all", log_freq=...)`` for one fit, committing what it logs.

    watch's hooks log histograms of every parameter and gradient with ``commit=False`` on every
    ``log_freq``-th forward/backward; the commit here stands in for the ``wandb.log`` that a
    logger would make on that step.
    """

    def __init__(self, log_freq: int, tmp: str) -> None:
        self.log_freq = log_freq
        self.tmp = tmp

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import wandb

        _wandb_run(self.tmp)
        wandb.watch(pl_module, log="all", log_freq=self.log_freq)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step % self.log_freq == 0:
            _wandb_run(self.tmp).log({"trainer/global_step": trainer.global_step})

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if _WANDB_RUN is not None:
            import wandb

            wandb.unwatch(pl_module)
