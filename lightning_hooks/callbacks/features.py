"""FeatureExtractor: which outputs to save and when: the stages, the hooks, pooling, sample ids.

The host buffer is ``_feature_buffer``; how tensors are named and pooled, ``_feature_outputs``; how
they become shards and a manifest on disk, ``output/_feature_store``; how they are read back,
``output/_feature_load``.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Optional, Union, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hooks.callbacks._base import HookCallback, log_step
from lightning_hooks.callbacks._feature_buffer import FeatureBuffer
from lightning_hooks.callbacks._feature_outputs import (
    Reduce,
    check_dtype,
    check_reduce,
    key_filter,
    named_tensors,
    output_name,
    pool,
    split_selection,
    wanted,
)
from lightning_hooks.core._compat import TENSORBOARD_LOGGERS
from lightning_hooks.core._deprecation import deprecated_arguments, renamed_value
from lightning_hooks.core._torch_internals import in_backward
from lightning_hooks.core._validation import check_int, check_names, check_path
from lightning_hooks.core.selection import ModuleSelection
from lightning_hooks.output._feature_load import MappedFeatures, iter_features, load_features
from lightning_hooks.output._feature_store import (
    RENAMED_STAGES,
    EmbeddingSample,
    ShardWriter,
    Stage,
    check_writable,
    write_manifest,
)

__all__ = ["FeatureExtractor", "MappedFeatures", "Stage", "iter_features", "load_features"]

_STAGES: tuple[str, ...] = get_args(Stage)

#: What ``stages`` takes: a stage, or until 0.3.0 ``"fit"``, the deprecated name of ``"train"``
#: (in the annotation, so that LightningCLI takes it from YAML too, and the warning says what to write).
StageArg = Union[Stage, Literal["fit"]]

#: The ``Trainer`` method that runs each stage's loop, where its name differs.
_TRAINER_FN = {"train": "fit"}


class FeatureExtractor(HookCallback):
    """Save chosen layers' outputs during ``predict`` (or ``validate``/``test``/training) as a dataset.

    Forward hooks pool and cast each selected output on its device, then copy it to host memory
    (asynchronously from CUDA). Every ``flush_every_n_batches`` batches the buffered rows become
    one safetensors shard per rank, ``<dirpath>/<stage>/rank<r>-shard<k>.safetensors``, written
    to a temporary name and renamed; when the stage ends on every rank, rank zero writes
    ``<dirpath>/<stage>/manifest.json`` (outputs, shapes, dtypes, rows per shard, ranks, CRC-32s,
    package and model versions). A set without a manifest did not finish, and
    :func:`load_features` refuses it unless told ``allow_partial=True``. A new run of a stage
    first deletes that stage's old files; batches still buffered when a run raises are dropped.

    Names: a tensor output is saved under the module's name (``"encoder.2"``); every tensor of a
    tuple, list, dict or dataclass output under ``"<module>:<key>"`` (``"lstm:0"``,
    ``"encoder:hidden"``, ``"lstm:1.0"`` when nested). A ``modules`` entry ``"encoder:hidden"``
    hooks ``encoder`` and keeps only the outputs it names (globs work: ``"lstm:0"``, ``"enc.*:h*"``).

    Sample ids: in ``predict`` each row carries the dataset index of its sample, from the batch
    indices Lightning's prediction loop records, so :func:`load_features` returns rows in dataset
    order on one process or under DDP's sampler (repeats it pads with dropped), and ``ids``
    with ``return_ids=True``. A tensor whose dim 0 is not the batch (an LSTM's ``h_n``) is not
    saved there, with a warning; an output whose module runs several times per batch keeps its
    rows in call order without ids. Other stages record no ids: rows come by rank, then batch.

    Stages are named as Lightning's ``RunningStage`` names the loops: ``"train"`` (the training
    batches of ``fit``), ``"validate"`` (``trainer.validate``, not the loop inside ``fit``),
    ``"test"``, ``"predict"``. Hooks are attached at the start of each enabled stage and removed
    at its end. ``dirpath`` is checked for writing in ``setup``, before the first batch.

    Args:
        modules: The layers to save, as globs over qualified names (``"encoder.*"``), module
            types, a predicate or a list; ``"module:key"`` entries pick outputs (see above). The
            only argument taken by position; the others are keyword-only.
        dirpath: Directory to write under; created if needed. One extractor per ``dirpath``.
        stages: The loops to extract in (a name or a list): any of ``"train"``, ``"validate"``,
            ``"test"``, ``"predict"``.
        flush_every_n_batches: Batches to buffer on host before writing a shard.
        reduce: Pool each saved tensor over ``reduce_dim`` on its device: ``"mean"``, ``"max"``,
            ``"cls"`` (index 0: the first token), or a callable taking the rows to rows; a tensor
            without that dim is saved as is. None saves whole outputs.
        reduce_dim: The dim (or tuple of dims) to pool: 1 for the tokens of ``(N, L, D)``,
            ``(2, 3)`` for the pixels of ``(N, C, H, W)``.
        dtype: Cast saved tensors to this dtype (``torch.float16`` halves the disk); None keeps theirs.
        max_rows: The most rows saved per output per stage run on each rank; None for all.
        model_version: A version string for the model (a checkpoint tag), kept in the manifest.
        embedding_samples: If positive and a ``TensorBoardLogger`` is attached, at the end of
            each stage rank zero logs a uniform random sample of this many of its rows per output
            (flattened to vectors) to the TensorBoard embedding projector.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``modules`` is None, ``dirpath`` is empty, ``stages`` is empty or holds an
            unknown name, ``flush_every_n_batches`` or ``max_rows`` < 1, ``embedding_samples`` < 0,
            ``reduce`` is an unknown name or ``reduce_dim`` < 1; in ``setup``, if a pattern matches no module.
        OSError: In ``setup``, if ``dirpath`` cannot be written ("read-only", "disk full"); while
            writing, naming the shard that could not be written.

    Example::

        extractor = FeatureExtractor(["encoder.2", "head"], dirpath="features", reduce="mean")
        trainer = pl.Trainer(callbacks=[extractor])
        trainer.predict(model, dataloaders=loader)
        embeddings, ids = load_features("features", "encoder.2", return_ids=True)

    """

    @deprecated_arguments("FeatureExtractor", old_order=(
        "modules", "dirpath", "stages", "flush_every_n_batches", "embedding_samples"), positional=1)
    def __init__(
        self,
        modules: ModuleSelection,
        *,
        dirpath: Union[str, os.PathLike],
        stages: Union[StageArg, tuple[StageArg, ...], list[StageArg]] = ("validate", "predict"),
        flush_every_n_batches: int = 16,
        reduce: Optional[Reduce] = None,
        reduce_dim: Union[int, tuple[int, ...]] = 1,
        dtype: Optional[torch.dtype] = None,
        max_rows: Optional[int] = None,
        model_version: Optional[str] = None,
        embedding_samples: int = 0,
    ) -> None:
        if modules is None:
            raise ValueError("`modules` is required: name the layers to save, e.g. modules='encoder.*'")
        check_path("dirpath", dirpath)
        named: Any = [stages] if isinstance(stages, str) else stages
        if isinstance(named, (tuple, list)):
            renamed = []
            for stage in named:  # a loop, not a comprehension: the warning points at the user's line
                renamed.append(renamed_value("FeatureExtractor", "stages", stage, RENAMED_STAGES, depth=3))
            named = renamed
        chosen = check_names("stages", named, _STAGES, what="stage")
        check_int("flush_every_n_batches", flush_every_n_batches, low=1)
        check_int("embedding_samples", embedding_samples, low=0)
        check_int("max_rows", max_rows, low=1, optional=True, none_means="no limit")
        self._dims = check_reduce(reduce, reduce_dim)
        check_dtype(dtype)
        if model_version is not None and not isinstance(model_version, str):
            raise TypeError(f"`model_version` must be a str or None, got {model_version!r}: pass e.g. 'v3-epoch12'")
        selection, self._keyed = split_selection(modules)
        super().__init__(selection)
        self.dirpath, self.stages, self.flush_every_n_batches = dirpath, chosen, flush_every_n_batches
        self.reduce, self.reduce_dim, self.dtype, self.max_rows = reduce, reduce_dim, dtype, max_rows
        self.model_version, self.embedding_samples = model_version, embedding_samples
        self._stage: Optional[str] = None
        self._writer: Optional[ShardWriter] = None
        self._buffer = FeatureBuffer(max_rows)
        self._indices: Optional[list[int]] = None
        self._loader = 0
        self._warned: set[str] = set()
        self._async_copies = False
        self._embeddings: Optional[EmbeddingSample] = None
        self._about: dict[str, Any] = {}

    @property
    def buffered_batches(self) -> int:
        """The most outputs any saved output holds on host now: one per buffered batch and call."""
        return self._buffer.batches

    def _register(self, index: int, name: str, module: nn.Module) -> list[RemovableHandle]:
        return [module.register_forward_hook(self._guard(name, self._make_hook(name)))]

    def _make_hook(self, module_name: str) -> Any:
        globs = key_filter(module_name, self._keyed)

        def save_output(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward():  # gradient checkpointing recomputing an output already saved
                return
            found = named_tensors(output)
            if not found:
                raise TypeError(f"it returned {type(output).__name__}, with no tensor that has a batch dim")
            for path, tensor in found:
                name = output_name(module_name, path)
                if wanted(name, globs) and not self._buffer.full(name) and self._is_batch(name, tensor):
                    self._keep(name, tensor)

        return save_output

    def _is_batch(self, name: str, tensor: Tensor) -> bool:
        """Whether ``tensor``'s dim 0 is the batch's samples (always, where the batch size is unknown)."""
        if self._indices is None or tensor.shape[0] == len(self._indices):
            return True
        self._warn_once(name, f"FeatureExtractor: {name!r} has {tensor.shape[0]} rows for a batch of"
                              f" {len(self._indices)} samples (its dim 0 is not the batch), so it is not saved.")
        return False

    @torch.no_grad()
    def _keep(self, name: str, tensor: Tensor) -> None:
        tensor = pool(tensor.detach(), self.reduce, self._dims)
        if self.dtype is not None:
            tensor = tensor.to(self.dtype)
        self._async_copies |= tensor.is_cuda
        self._buffer.add(name, tensor.to("cpu", non_blocking=tensor.is_cuda, copy=True))

    def _warn_once(self, name: str, message: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            rank_zero_warn(message)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the selection and, if this run extracts, check ``dirpath`` can be written: before any batch."""
        super().setup(trainer, pl_module, stage)
        if any(_TRAINER_FN.get(s, s) == trainer.state.fn for s in self.stages):
            check_writable(self.dirpath)

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
        self._batch_start(trainer, "train", batch_idx, 0)

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        """Open the hooks for this batch."""
        self._batch_start(trainer, "validate", batch_idx, dataloader_idx)

    def on_test_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        """Open the hooks for this batch."""
        self._batch_start(trainer, "test", batch_idx, dataloader_idx)

    def on_predict_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None:
        """Open the hooks for this batch; note its samples' dataset indices."""
        self._batch_start(trainer, "predict", batch_idx, dataloader_idx)

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

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Remove the hooks and drop what is buffered (the set stays without a manifest: incomplete)."""
        super().on_exception(trainer, pl_module, exception)
        self._stage, self._collecting = None, False
        self._buffer = FeatureBuffer(self.max_rows)

    def _begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage not in self.stages or trainer.state.fn != _TRAINER_FN.get(stage, stage):
            return
        self._stage, self._loader, self._indices = stage, 0, None
        self._buffer = FeatureBuffer(self.max_rows)
        self._embeddings = self._embedding_sample(trainer)
        self.attach(pl_module)
        self._writer = ShardWriter(self.dirpath, stage, trainer.global_rank, trainer.world_size)

    def _embedding_sample(self, trainer: pl.Trainer) -> Optional[EmbeddingSample]:
        if not self.embedding_samples or not trainer.is_global_zero:
            return None
        found = next((lg for lg in trainer.loggers if isinstance(lg, TENSORBOARD_LOGGERS)), None)
        if found is None:
            rank_zero_warn("FeatureExtractor: `embedding_samples` is set but there is no TensorBoardLogger")
            return None
        return EmbeddingSample(found, self.embedding_samples)

    def _batch_start(self, trainer: pl.Trainer, stage: str, batch_idx: int, dataloader_idx: int) -> None:
        self._collecting = self._stage == stage and not trainer.sanity_checking
        if not self._collecting:
            return
        if dataloader_idx != self._loader:  # a shard holds one dataloader's rows
            self._flush()
            self._loader = dataloader_idx
        self._indices = _batch_indices(trainer, batch_idx, dataloader_idx) if stage == "predict" else None

    def _batch_end(self, stage: str) -> None:
        if self._stage != stage:
            return
        self._collecting = False
        for name in self._buffer.end_batch(self._indices):
            self._warn_once(name, f"FeatureExtractor: {name!r} got a row count other than the batch's (its"
                                  " module runs several times per batch?): its rows carry no sample ids.")
        if self._buffer.batches >= self.flush_every_n_batches:
            self._flush()

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._stage != stage:
            return
        self._flush()
        assert self._writer is not None  # made by `_begin`, which set `self._stage` to `stage`
        self._writer.finish()
        if trainer.world_size > 1:
            trainer.strategy.barrier("lightning_hooks.features")
        if trainer.is_global_zero:
            write_manifest(self.dirpath, stage, trainer.world_size, self._describe(trainer, pl_module))
        if self._embeddings is not None:
            self._embeddings.log(stage, log_step(trainer))
        self.detach()
        self._stage, self._collecting = None, False

    def _flush(self) -> None:
        if self._async_copies:  # the device-to-host copies must land before the host reads them
            torch.cuda.synchronize()
            self._async_copies = False
        assert self._writer is not None
        features, ids = self._buffer.take()
        if not features:
            return
        self._writer.write(features, ids, self._loader)
        if self._embeddings is not None:
            for name, rows in features.items():
                self._embeddings.add(name, rows)

    def _describe(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """What the manifest says of the run besides the shards: what was watched, how, by which model."""
        model = type(pl_module)
        return {
            "watched": self.module_names,
            "settings": {"reduce": getattr(self.reduce, "__name__", self.reduce), "reduce_dim": self._dims,
                         "dtype": None if self.dtype is None else str(self.dtype), "max_rows": self.max_rows},
            "model": {"class": f"{model.__module__}.{model.__qualname__}", "version": self.model_version,
                      "parameters": sum(p.numel() for p in pl_module.parameters()),
                      "checkpoint": trainer.ckpt_path, "hparams": dict(pl_module.hparams)},
        }


def _batch_indices(trainer: pl.Trainer, batch_idx: int, dataloader_idx: int) -> Optional[list[int]]:
    """The dataset indices of this predict batch's samples, as Lightning records them for prediction writers.

    Lightning wraps each predict dataloader's batch sampler so that it keeps the indices of every
    batch it yields (``seen_batch_indices``); None where the loader is not a wrapped DataLoader.
    """
    loaders: Any = trainer.predict_dataloaders
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    loader = loaders[dataloader_idx] if isinstance(loaders, (list, tuple)) else loaders
    seen = getattr(getattr(loader, "batch_sampler", None), "seen_batch_indices", None)
    if seen is None or batch_idx >= len(seen):
        return None
    return [int(i) for i in seen[batch_idx]]
