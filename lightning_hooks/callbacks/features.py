"""FeatureExtractor: which outputs to save and when: the stages, the hooks, pooling, sample ids.

The host buffer is ``_feature_buffer``; how tensors are named and pooled, ``_feature_outputs``; how
they become shards and a manifest on disk, ``output/_feature_store``; how they are read back,
``output/_feature_load``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hooks.callbacks._base import HookCallback, log_step
from lightning_hooks.callbacks._feature_buffer import FeatureBuffer, batch_indices
from lightning_hooks.callbacks._feature_outputs import (
    Reduce,
    check_dtype,
    check_ids_and_version,
    check_reduce,
    key_filter,
    named_tensors,
    output_name,
    pool,
    split_selection,
    wanted,
)
from lightning_hooks.callbacks._feature_stages import StageHooks
from lightning_hooks.core._compat import TENSORBOARD_LOGGERS
from lightning_hooks.core._torch_internals import in_backward
from lightning_hooks.core._validation import check_int, check_names, check_path
from lightning_hooks.core.selection import ModuleSelection
from lightning_hooks.output._feature_load import MappedFeatures, iter_features, load_features
from lightning_hooks.output._feature_store import (
    EmbeddingSample,
    ShardWriter,
    Stage,
    check_writable,
    model_record,
    write_manifest,
)

__all__ = ["FeatureExtractor", "MappedFeatures", "Stage", "iter_features", "load_features"]

_STAGES: tuple[str, ...] = get_args(Stage)

#: The ``Trainer`` method that runs each stage's loop, where its name differs.
_TRAINER_FN = {"train": "fit"}


class FeatureExtractor(StageHooks, HookCallback):
    """Save chosen layers' outputs during ``predict`` (or ``validate``/``test``/training) as a dataset.

    Forward hooks pool and cast each selected output on its device, then copy it to host memory
    (asynchronously from CUDA). Every ``flush_every_n_batches`` batches the rows become one
    safetensors shard per rank, ``<dirpath>/<stage>/rank<r>-shard<k>.safetensors`` (written to a
    temporary name, then renamed); when the stage ends on every rank, rank zero writes
    ``<dirpath>/<stage>/manifest.json``. A set without it did not finish: :func:`load_features`
    refuses it unless ``allow_partial=True``. A new run of a stage first deletes its old files.
    See ``docs/features.md``.

    Names: a tensor output is saved under the module's name (``"encoder.2"``), every tensor of a
    tuple, list, dict or dataclass output under ``"<module>:<key>"`` (``"lstm:0"``,
    ``"encoder:hidden"``, ``"lstm:1.0"`` nested). A ``modules`` entry ``"encoder:hidden"`` hooks
    ``encoder`` and keeps only the outputs it names (a glob).

    Sample ids: in ``predict`` each row carries its sample's dataset index (from the batch indices
    Lightning's prediction loop records), so :func:`load_features` returns rows in dataset order,
    also under DDP's sampler, with their ``ids``. There a tensor whose dim 0 is not the batch (an
    LSTM's ``h_n``) is not saved, with a warning; a module run several times per batch saves its
    rows in call order, without ids. Other stages record no ids (rows come by rank, then batch),
    unless ``sample_ids`` reads them from the batch (one ``.tolist()`` per batch).

    Stages, as Lightning's ``RunningStage`` names the loops: ``"train"`` (the training batches of
    ``fit``), ``"validate"`` (``trainer.validate``, not the loop inside ``fit``), ``"test"``,
    ``"predict"``. Hooks are on only while an enabled stage runs.

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
        dtype: Cast saved tensors to this dtype (``torch.float16`` or ``"float16"`` halves the disk);
            None keeps theirs.
        max_rows: The most rows saved per output per stage run on each rank; None for all.
        sample_ids: A function of the batch returning its samples' ids (``lambda batch: batch["id"]``,
            one per sample), used instead of Lightning's batch indices and in every stage; None
            takes the batch indices in ``predict`` and records no ids elsewhere.
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

    # Its hooks are on for its stage only, and collect at every batch of it.
    _hooks_follow_gate = False

    def __init__(
        self,
        modules: ModuleSelection,
        *,
        dirpath: Union[str, os.PathLike],
        stages: Union[Stage, tuple[Stage, ...], list[Stage]] = ("validate", "predict"),
        flush_every_n_batches: int = 16,
        reduce: Optional[Reduce] = None,
        reduce_dim: Union[int, tuple[int, ...]] = 1,
        dtype: Optional[Union[torch.dtype, str]] = None,
        max_rows: Optional[int] = None,
        sample_ids: Optional[Callable[[Any], Any]] = None,
        model_version: Optional[str] = None,
        embedding_samples: int = 0,
    ) -> None:
        if modules is None:
            raise ValueError("`modules` is required: name the layers to save, e.g. modules='encoder.*'")
        check_path("dirpath", dirpath)
        chosen = check_names("stages", stages, _STAGES, what="stage")
        check_int("flush_every_n_batches", flush_every_n_batches, low=1)
        check_int("embedding_samples", embedding_samples, low=0)
        check_int("max_rows", max_rows, low=1, optional=True, none_means="no limit")
        self._dims = check_reduce(reduce, reduce_dim)
        cast = check_dtype(dtype)
        check_ids_and_version(sample_ids, model_version)
        selection, self._keyed = split_selection(modules)
        super().__init__(selection)
        self.dirpath, self.stages, self.flush_every_n_batches = dirpath, chosen, flush_every_n_batches
        self.reduce, self.reduce_dim, self.dtype, self.max_rows = reduce, reduce_dim, cast, max_rows
        self.sample_ids, self.model_version, self.embedding_samples = sample_ids, model_version, embedding_samples
        self._stage: Optional[str] = None
        self._writer: Optional[ShardWriter] = None
        self._buffer = FeatureBuffer(max_rows)
        self._indices: Optional[list[int]] = None
        self._loader = 0
        self._warned: set[str] = set()
        self._async_copies = False
        self._embeddings: Optional[EmbeddingSample] = None

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

    def _batch_start(self, trainer: pl.Trainer, stage: str, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        self._collecting = self._stage == stage and not trainer.sanity_checking
        if not self._collecting:
            return
        if dataloader_idx != self._loader:  # a shard holds one dataloader's rows
            self._flush()
            self._loader = dataloader_idx
        if self.sample_ids is not None:
            self._indices = [int(i) for i in torch.as_tensor(self.sample_ids(batch)).reshape(-1).tolist()]
        else:
            self._indices = batch_indices(trainer, batch_idx, dataloader_idx) if stage == "predict" else None

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
        settings = {"reduce": getattr(self.reduce, "__name__", self.reduce), "reduce_dim": self._dims,
                    "dtype": None if self.dtype is None else str(self.dtype), "max_rows": self.max_rows}
        return {"watched": self.module_names, "settings": settings,
                "model": model_record(pl_module, trainer.ckpt_path, self.model_version)}
