"""Which of Lightning's hooks belongs to which stage, for FeatureExtractor: one method each, all alike.

Each calls the extractor's ``_begin``, ``_batch_start``, ``_batch_end`` or ``_finish`` with its
stage's name; what those do is in ``features.py``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


class StageHooks:
    """Lightning's start, batch start, batch end and end hooks of the four loops, dispatched by stage."""

    def _begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        raise NotImplementedError

    def _batch_start(self, trainer: pl.Trainer, stage: str, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        raise NotImplementedError

    def _batch_end(self, stage: str) -> None:
        raise NotImplementedError

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        raise NotImplementedError

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Attach nothing yet: hooks go on at the start of each enabled stage."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start extracting training batches, if ``"train"`` is enabled."""
        self._begin(trainer, pl_module, "train")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start extracting, if this is ``trainer.validate`` and ``"validate"`` is enabled."""
        self._begin(trainer, pl_module, "validate")

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start extracting, if ``"test"`` is enabled."""
        self._begin(trainer, pl_module, "test")

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start extracting, if ``"predict"`` is enabled."""
        self._begin(trainer, pl_module, "predict")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Open the hooks for this batch."""
        self._batch_start(trainer, "train", batch, batch_idx, 0)

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        """Open the hooks for this batch."""
        self._batch_start(trainer, "validate", batch, batch_idx, dataloader_idx)

    def on_test_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        """Open the hooks for this batch."""
        self._batch_start(trainer, "test", batch, batch_idx, dataloader_idx)

    def on_predict_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None:
        """Open the hooks for this batch; note its samples' dataset indices."""
        self._batch_start(trainer, "predict", batch, batch_idx, dataloader_idx)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Close the hooks; write a shard every ``flush_every_n_batches`` batches."""
        self._batch_end("train")

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Close the hooks; write a shard every ``flush_every_n_batches`` batches."""
        self._batch_end("validate")

    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Close the hooks; write a shard every ``flush_every_n_batches`` batches."""
        self._batch_end("test")

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        """Close the hooks; write a shard every ``flush_every_n_batches`` batches."""
        self._batch_end("predict")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the last shard and the manifest; remove the hooks."""
        self._finish(trainer, pl_module, "train")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the last shard and the manifest; remove the hooks."""
        self._finish(trainer, pl_module, "validate")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the last shard and the manifest; remove the hooks."""
        self._finish(trainer, pl_module, "test")

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the last shard and the manifest; remove the hooks."""
        self._finish(trainer, pl_module, "predict")
