"""FeatureExtractor: which layers' outputs to save and when: the stages, the hooks, the host buffer.

How the buffered outputs become shards on disk, and how ``load_features`` reads them back, is
in ``_feature_store``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hooks.callbacks._base import HookCallback, log_step
from lightning_hooks.core._compat import TENSORBOARD_LOGGERS
from lightning_hooks.core._deprecation import deprecated_arguments, renamed_value
from lightning_hooks.core._torch_internals import in_backward
from lightning_hooks.core._validation import check_int, check_names, check_path
from lightning_hooks.core.selection import ModuleSelection
from lightning_hooks.output._feature_store import (
    RENAMED_STAGES,
    EmbeddingSample,
    ShardWriter,
    Stage,
    layer_dir,
    load_features,
)

__all__ = ["FeatureExtractor", "Stage", "load_features"]

_STAGES: tuple[str, ...] = get_args(Stage)

#: What ``stages`` takes: a stage, or until 0.3.0 ``"fit"``, the deprecated name of ``"train"``
#: (in the annotation, so that LightningCLI takes it from YAML too, and the warning says what to write).
StageArg = Union[Stage, Literal["fit"]]

#: The ``Trainer`` method that runs each stage's loop, where its name differs.
_TRAINER_FN = {"train": "fit"}


class FeatureExtractor(HookCallback):
    """Save the outputs of chosen layers during ``validate``/``test``/``predict`` (or training).

    Forward hooks copy each selected layer's output, detached, to host memory (one copy per
    layer per batch; from CUDA it is asynchronous, with one synchronize per shard). Every
    ``flush_every_n_batches`` batches the buffered outputs of each layer are concatenated
    along dim 0 and written to ``<dirpath>/<stage>/<layer>/rank<r>-shard<k>.pt`` (``k``
    zero-padded, counting from 0 in each run), so at most that many outputs per layer are ever
    held on host. Read them back with :func:`load_features`.

    Stages are named as Lightning's ``RunningStage`` names the loops (and as
    ``ActivationMonitor``'s ``stages``): ``"train"`` covers the training batches of
    ``trainer.fit`` (it was ``"fit"``, a deprecated name now), ``"validate"`` the validation
    loop of ``trainer.validate`` (not the one inside ``fit``, nor its sanity check), ``"test"``
    and ``"predict"`` those of ``trainer.test`` and ``trainer.predict``. Hooks are attached at
    the start of each enabled stage and removed at its end. A new run of a stage first deletes
    this rank's old shards of the selected layers for that stage; batches still buffered when a run raises are dropped.

    Layer outputs: a tensor is saved as is; from a tuple, list or dict output (an LSTM's
    ``(output, (h, c))``) the first tensor found is saved, with a warning once per layer. The
    shape past dim 0 must stay the same from batch to batch; a layer that changes it, or
    returns no tensor, is skipped from then on with a warning. A layer called several times in
    one batch saves one output per call, in call order (and so fills the buffer sooner).

    Under DDP every rank writes its own shards (``rank<r>`` in the name). With Lightning's
    distributed sampler rank ``r`` of ``W`` sees samples ``r, r + W, r + 2W, ...`` of an
    unshuffled dataset, so ``load_features(..., rank=r)`` lines up with ``dataset[r::W]``
    (padded with repeats when the dataset does not split evenly); across several dataloaders
    the features are concatenated in loop order.

    Args:
        modules: The layers to save, as globs over qualified names (``"encoder.*"``), module
            types, a predicate or a list; see :func:`~lightning_hooks.select_modules`. The only
            argument taken by position; the others are keyword-only.
        dirpath: Directory to write the shards under; created if needed.
        stages: The loops to extract in (a name or a list): any of ``"train"``, ``"validate"``,
            ``"test"``, ``"predict"``.
        flush_every_n_batches: Batches to buffer on host before writing a shard.
        embedding_samples: If positive and a ``TensorBoardLogger`` is attached, at the end of
            each stage rank zero logs a uniform random sample of this many of its rows per layer
            (flattened to vectors) to the TensorBoard embedding projector.

    Raises:
        TypeError: If ``dirpath`` is not a path, ``stages`` not a name or a list of names, or
            ``flush_every_n_batches`` or ``embedding_samples`` not an int.
        ValueError: If ``modules`` is None, ``dirpath`` is empty, ``stages`` is empty or holds an
            unknown name, or ``flush_every_n_batches`` < 1 or ``embedding_samples`` < 0; in ``setup``, if a
            pattern matches no module.

    Example::

        extractor = FeatureExtractor(modules=["encoder.2", "head"], dirpath="features")
        trainer = pl.Trainer(callbacks=[extractor])
        trainer.predict(model, dataloaders=loader)
        embeddings = load_features("features", "encoder.2")  # (n_samples, ...)

    """

    # Its hooks are on for its stage only, and collect at every batch of it.
    _hooks_follow_gate = False

    @deprecated_arguments("FeatureExtractor", old_order=(
        "modules", "dirpath", "stages", "flush_every_n_batches", "embedding_samples"), positional=1)
    def __init__(
        self,
        modules: ModuleSelection,
        *,
        dirpath: Union[str, os.PathLike],
        stages: Union[StageArg, tuple[StageArg, ...], list[StageArg]] = ("validate", "predict"),
        flush_every_n_batches: int = 16,
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
        for arg, value, low in (("flush_every_n_batches", flush_every_n_batches, 1),
                                ("embedding_samples", embedding_samples, 0)):
            check_int(arg, value, low=low)
        super().__init__(modules)
        self.dirpath = dirpath
        self.stages = chosen
        self.flush_every_n_batches = flush_every_n_batches
        self.embedding_samples = embedding_samples
        self._stage: Optional[str] = None
        self._writer: Optional[ShardWriter] = None
        self._buffer: dict[str, list[Tensor]] = {}
        self._shapes: dict[str, torch.Size] = {}
        self._warned: set[str] = set()
        self._async_copies = False
        self._embeddings: Optional[EmbeddingSample] = None

    @property
    def buffered_batches(self) -> int:
        """The most outputs any layer holds on host now: one per buffered batch and call."""
        return max((len(chunks) for chunks in self._buffer.values()), default=0)

    def layer_dir(self, stage: str, layer: str) -> Path:
        """Return the directory holding the shards of ``layer`` for ``stage``."""
        return layer_dir(self.dirpath, stage, layer)

    def _register(self, index: int, name: str, module: nn.Module) -> list[RemovableHandle]:
        return [module.register_forward_hook(self._guard(name, self._make_hook(name)))]

    def _make_hook(self, name: str) -> Any:
        def save_output(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward():  # gradient checkpointing recomputing an output already saved
                return
            tensor = self._as_tensor(name, output)
            expected = self._shapes.setdefault(name, tensor.shape[1:])
            if tensor.shape[1:] != expected:
                raise ValueError(
                    f"its output shape {tuple(tensor.shape)} differs past dim 0 from earlier batches'"
                    f" (N, {', '.join(map(str, expected))}), so the outputs cannot be concatenated"
                )
            self._async_copies |= tensor.is_cuda
            copy = tensor.detach().to("cpu", non_blocking=tensor.is_cuda, copy=True)
            self._buffer.setdefault(name, []).append(copy)

        return save_output

    def _as_tensor(self, name: str, output: Any) -> Tensor:
        tensor = _first_tensor(output)
        if tensor is None or tensor.dim() == 0:
            raise TypeError(f"it returned {type(output).__name__}, with no tensor that has a batch dim")
        if not isinstance(output, Tensor) and name not in self._warned:
            self._warned.add(name)
            rank_zero_warn(
                f"FeatureExtractor: module {name!r} returns a {type(output).__name__}; saving its"
                f" first tensor, of shape {tuple(tensor.shape)}."
            )
        return tensor

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

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        """Open the hooks for this batch."""
        self._batch_start(trainer, "train")

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        """Open the hooks for this batch."""
        self._batch_start(trainer, "validate")

    def on_test_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        """Open the hooks for this batch."""
        self._batch_start(trainer, "test")

    def on_predict_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        """Open the hooks for this batch."""
        self._batch_start(trainer, "predict")

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
        """Write the last shard and remove the hooks."""
        self._finish(trainer, "train")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the last shard and remove the hooks."""
        self._finish(trainer, "validate")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the last shard and remove the hooks."""
        self._finish(trainer, "test")

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the last shard and remove the hooks."""
        self._finish(trainer, "predict")

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Remove the hooks and drop what is buffered."""
        super().on_exception(trainer, pl_module, exception)
        self._stage, self._collecting = None, False
        self._buffer.clear()

    def _begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage not in self.stages or trainer.state.fn != _TRAINER_FN.get(stage, stage):
            return
        self._stage = stage
        self._buffer.clear()
        self._shapes.clear()
        self._embeddings = self._embedding_sample(trainer)
        self.attach(pl_module)
        self._writer = ShardWriter(self.dirpath, stage, self.module_names, trainer.global_rank, trainer.world_size)

    def _embedding_sample(self, trainer: pl.Trainer) -> Optional[EmbeddingSample]:
        if not self.embedding_samples or not trainer.is_global_zero:
            return None
        found = next((lg for lg in trainer.loggers if isinstance(lg, TENSORBOARD_LOGGERS)), None)
        if found is None:
            rank_zero_warn("FeatureExtractor: `embedding_samples` is set but there is no TensorBoardLogger")
            return None
        return EmbeddingSample(found, self.embedding_samples)

    def _batch_start(self, trainer: pl.Trainer, stage: str) -> None:
        self._collecting = self._stage == stage and not trainer.sanity_checking

    def _batch_end(self, stage: str) -> None:
        if self._stage != stage:
            return
        self._collecting = False
        if self.buffered_batches >= self.flush_every_n_batches:
            self._flush()

    def _finish(self, trainer: pl.Trainer, stage: str) -> None:
        if self._stage != stage:
            return
        self._flush()
        if self._embeddings is not None:
            self._embeddings.log(stage, log_step(trainer))
        self.detach()
        self._stage, self._collecting = None, False

    def _flush(self) -> None:
        if self._async_copies:  # the device-to-host copies must land before the host reads them
            torch.cuda.synchronize()
            self._async_copies = False
        assert self._writer is not None  # made by `_begin`, which set `self._stage` to `stage`
        written = self._writer.write(self._buffer)
        if self._embeddings is not None:
            for layer, features in written.items():
                self._embeddings.add(layer, features)
        self._buffer.clear()


def _first_tensor(output: Any) -> Optional[Tensor]:
    """Return ``output`` if it is a tensor, else the first tensor inside it, depth first."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict):
        output = list(output.values())
    if not isinstance(output, (tuple, list)):
        return None
    return next((t for t in map(_first_tensor, output) if t is not None), None)
