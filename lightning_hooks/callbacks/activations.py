"""ActivationMonitor: statistics and histograms of module outputs on logged training steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional, Union, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hooks.callbacks._activation_grads import GRAD_PREFIX, inverse_loss_scale
from lightning_hooks.callbacks._activation_hooks import ActivationHooks
from lightning_hooks.callbacks._activation_rows import ActivationFigures
from lightning_hooks.callbacks._base import (
    _log_interval,
    _validate_interval,
    _validate_stats,
    log_step,
)
from lightning_hooks.callbacks._judged_rows import lookups
from lightning_hooks.core._validation import check_bool, check_names
from lightning_hooks.core.selection import ModuleSelection, check_limit, short_list, validate_limit
from lightning_hooks.measure._stat_rows import DEFAULT_STATS, STAT_NAMES
from lightning_hooks.measure.aggregate import StatBlock
from lightning_hooks.measure.stats import Bins, binning
from lightning_hooks.output.figures import ScalarBlock
from lightning_hooks.output.sinks import destinations, log_layout

Stage = Literal["train", "validate"]

_PREFIXES = {"train": "activations", "validate": "val_activations"}


class ActivationMonitor(ActivationHooks):
    """Log statistics and histograms of what the selected modules output during training.

    On a logged training step (as Lightning logs: the loop's step ``n`` with ``(n + 1) %
    log_every_n_steps == 0``, and step 0) a forward hook on each selected module adds every
    tensor it returns (inside tuples, lists, dicts and dataclasses; other values are skipped) to
    that module's row of on-device statistics. Rows add up over the step's micro-batches
    (gradient accumulation) and over repeated calls of a module (shared layers, loops): the
    ``calls`` stat says how many calls a row holds on one rank (across ranks the most of any
    rank, as one process would count them; a call counts once however many tensors it returns;
    recomputation by gradient checkpointing in backward is not a call, and calls that return
    nothing summarisable are not counted). Once the step's optimizer step is done (at the end of
    its last training batch) the rows are reduced across ranks once, copied to the host once,
    and logged at that step (where ``self.log`` writes the batch's figures) as
    ``activations/<module>/<stat>`` scalars to every logger and as ``activations/<module>``
    histograms to TensorBoard and W&B. On other steps the hooks are off the modules. Each
    TensorBoardLogger also gets a Custom Scalars layout with one chart per stat that draws
    every module (``std by layer``); a chart is added (the layout rewritten) when its first
    figure is logged, so that no chart is empty.

    Non-finite values are left out of the moments and the histogram and counted as
    ``nan_count``, ``posinf_count`` and ``neginf_count``; a diverging run keeps logging. Those
    counters not in ``stats`` are logged for a module only at logged steps where they are not
    zero, and at its next logged step (where the chart comes back to 0).

    With the default ``stats`` (None), no chart is flat by construction: ``mean``, ``std`` and
    ``abs_max`` are logged at every logged step; ``nonfinite_fraction`` like the counters (where
    it is not zero, and at the next logged step); and ``zero_fraction`` for a module from its
    first logged step with an exact zero in its output on, at every logged step (a ReLU's from
    the start; a Linear's or a GELU's, almost never exactly 0, only once they are). A stat named
    in ``stats`` is logged at every logged step.
    Integer and bool outputs are summarised as floats, complex outputs by their magnitude;
    sparse, quantized and empty tensors are skipped.

    Args:
        modules: Which modules to watch: None (every module whose parameters are all its own,
            a parametrized layer whole, plus activation modules: see ``is_default_module``; and
            each block of a stack, a transformer's layers or a ResNet's blocks, whose output is
            the residual stream: see ``stack_blocks``), a
            name glob, an ``nn.Module`` subclass, a predicate ``(name, module) -> bool``, or a
            list of globs and subclasses. The only argument
            taken by position; the others are keyword-only.
        log_every_n_steps: Log every this many optimizer steps. None: the Trainer's
            ``log_every_n_steps``.
        stats: Which scalars to log every logged step, from :data:`STAT_NAMES`. None (the
            default): :data:`DEFAULT_STATS` (mean, std, abs_max, zero_fraction,
            nonfinite_fraction), the last two only where they say something (above);
            ``stats=DEFAULT_STATS`` logs all five at every logged step, ``stats=STAT_NAMES``
            all twelve.
        histogram: Whether to write histograms to TensorBoard and W&B.
        bins: Histogram bins: a count of symmetric log-spaced bins covering all of float32,
            or increasing bin edges.
        inputs: Also record each module's positional inputs, as ``<module>.input``, read
            before the forward runs (so an in-place module reports the input it was given).
        stages: The loops whose forwards are logged, by Lightning's ``RunningStage`` names (as
            ``FeatureExtractor`` names them): ``"train"``, and ``"validate"`` for the validation
            loop of ``fit`` (summed over each validation run, under ``val_activations/``, sanity
            check excluded). A single name or a list.
        max_rows: The most rows (modules; with ``inputs`` a module's input shares its row's
            count) the selection may hold (None: no limit), so that a default selection on a
            very large model fails before training with a hint instead of logging thousands of
            tags a step. (GradientMonitor's is ``max_rows`` too).
        gradients: Also log, per selected module, the gradient of the loss with respect to its
            output, ``dL/d(output)`` (``activation_grads/<module>/<stat>`` and the histogram
            ``activation_grads/<module>``), with the same stats, bins, steps and host transfer as
            the forward figures, through a tensor hook on each output tensor (in-place ops, dict
            and dataclass outputs and modules returning their input work; a forward recomputed by
            gradient checkpointing is not watched twice, and the reentrant variant, whose first
            forward runs without grad, gives no gradient for the modules inside it). Summed over
            micro-batches. Under AMP with a GradScaler (``precision="16-mixed"``) they are
            unscaled as they are recorded (times ``1 / loss_scale``, as the parameters' gradients
            are measured); on a step where the scaler finds an Inf or a NaN and skips the
            optimizer step they are still logged, their non-finite values counted in
            ``nan_count``/``posinf_count``/``neginf_count``. Under DDP each rank's local gradient
            (of its own loss, before any averaging), combined across ranks as statistics (counts
            and sums add, extremes max). Training steps only.

    Raises:
        ValueError: For an unknown stat, ``bins`` < 1, ``log_every_n_steps`` < 1, an unknown
            stage, a bad ``max_rows``, or (before training) a module pattern that matches
            nothing or a selection of more than ``max_rows`` modules.
        TypeError: For an argument of the wrong type (a flag that is not a bool, a count that
            is not an int, ``stages`` that is not a name or a list of names).

    Example::

        from lightning import Trainer
        from lightning_hooks import ActivationMonitor

        trainer = Trainer(callbacks=[ActivationMonitor(log_every_n_steps=10, modules="encoder.*")])
    """

    _watches_blocks = True

    def __init__(
        self,
        modules: ModuleSelection = None,
        *,
        log_every_n_steps: Optional[int] = None,
        stats: Optional[Sequence[str]] = None,
        histogram: bool = True,
        bins: Bins = 128,
        inputs: bool = False,
        stages: Union[Stage, Sequence[Stage]] = ("train",),
        max_rows: Optional[int] = 1000,
        gradients: bool = False,
    ) -> None:
        super().__init__(modules)
        _validate_interval(log_every_n_steps)
        _validate_stats(DEFAULT_STATS if stats is None else stats, STAT_NAMES)
        validate_limit("max_rows", max_rows)
        chosen = check_names("stages", stages, get_args(Stage), what="stage")
        check_bool("histogram", histogram)
        check_bool("inputs", inputs)
        check_bool("gradients", gradients)
        binning(bins)  # validates `bins`, and computes the edges every block of these bins shares
        self.log_every_n_steps = log_every_n_steps
        self.stats = None if stats is None else tuple(stats)
        self._figures = ActivationFigures(self.stats, histogram)  # which stat each row logs when; afresh each fit
        self.histogram = histogram
        self.bins = bins
        self.inputs = inputs
        self.gradients = gradients
        self.stages = chosen
        self.max_rows = max_rows
        self._every = 1
        self._blocks: dict[str, StatBlock] = {}
        self._block: Optional[StatBlock] = None
        self._pending_step: Optional[int] = None  # the log step being collected
        self._pending_global = 0  # ``trainer.global_step`` when it began: its optimizer step is done once this moves
        self._forward_order: Optional[dict[str, None]] = None  # modules as their hooks first fire, once per fit
        self._lookups: dict[str, str] = {}  # the watched embeddings and their weights' rows, written with the order
        self._ordering = False  # whether the forward order is still being recorded (up to the first backward)
        self._grad_scale: list[Optional[torch.Tensor]] = [None]  # AMP's 1 / loss_scale for this backward
        self._hook_fns: dict[tuple[int, str, int, bool], tuple[Callable[..., Any], Callable[..., Any]]] = {}
        self._carried: list[tuple[torch.Tensor, ScalarBlock]] = []  # other callbacks' figures of the step (`carry`)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve modules and the logging interval before training starts."""
        super().setup(trainer, pl_module, stage)
        self._check_size()
        self._every = _log_interval(self.log_every_n_steps, trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the hooks, size the per-step buffers to the modules they went on, write the layout."""
        self._hook_fns = {}
        super().on_fit_start(trainer, pl_module)
        self._check_size()
        names = self.module_names + ([f"{n}.input" for n in self.module_names] if self.inputs else [])
        written, _ = destinations(trainer, type(self).__name__, self.histogram, listened_histograms=True,
                                  skipped="it computes nothing")
        self._blocks = {s: StatBlock(names + self._grad_names(s), self.bins, pl_module.device)
                        for s in self.stages} if written else {}
        self._block, self._pending_step, self._carried = None, None, []
        self._forward_order, self._ordering = {}, True
        watched = set(self.module_names)  # the embeddings among them, written with the forward order
        self._lookups = {row: weight for row, weight in lookups(pl_module).items() if row in watched}
        self._figures = ActivationFigures(self.stats, self.histogram)
        grads = [GRAD_PREFIX] if self._grad_names("train") else []
        charts = {category: chart for prefix in [_PREFIXES[stage] for stage in self.stages] + grads
                  for category, chart in self._figures.charts(prefix).items()}
        log_layout(trainer, charts, trainer.global_step)  # one layout event, every category

    def _grad_names(self, stage: str) -> list[str]:
        """The gradient rows of ``stage``'s block (training only): one per module, after the others."""
        return list(self.module_names) if self.gradients and stage == "train" else []

    def _check_size(self) -> None:
        """Refuse a selection of more than ``max_rows`` modules, before training."""
        tags = self._figures.tags_per_row * (1 + self.inputs + self.gradients)
        check_limit(type(self).__name__, "max_rows", self.max_rows, len(self._targets), tags,
                    self.module_names)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Open the gate on logged steps."""
        step = log_step(trainer)
        if self._pending_step is not None and self._pending_step != step:
            self._flush(trainer, "train")  # an earlier step ended without an optimizer step
        if self.collects(step):
            if self._pending_step is None:
                self._pending_global = trainer.global_step
            self._block, self._collecting, self._pending_step = self._blocks["train"], True, step
        else:
            self._collecting = False  # hooks kept from the step before (see `_close_gate`) go

    def collects(self, step: int) -> bool:
        """Whether the training forwards of log step ``step`` are collected: a logged step, or one watched closely."""
        return "train" in self._blocks and self._logs_at(step, self._every)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """On a logged step, take AMP's ``1 / loss_scale`` for the gradients about to be recorded (no sync).

        The forward order is one forward pass's: the next micro-batch's calls (gradient accumulation) are not in it.
        """
        if self._forward_order:
            self._ordering = False
        if self.gradients and self._block is not None and self._block is self._blocks.get("train"):
            self._grad_scale[0] = inverse_loss_scale(trainer, loss.device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Close the gate; log the step's figures once its optimizer step is done.

        Flushing here rather than at the optimizer step keeps every forward of the batch in its
        step: closures re-run by LBFGS, several optimizers under manual optimization.
        """
        # Logging every step, the hooks stay for the next one (the gate closed; see `_close_gate`). A step
        # that never opened the gate has nothing to close: no look at the next step.
        if self._gate or self._gated:
            self._close_gate(reopens="train" in self._blocks and self._is_logged_next(trainer, self._every))
        if self._pending_step is not None and self._pending_global != trainer.global_step:
            self._flush(trainer, "train")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log what an unfinished last step collected."""
        self._collecting = False
        if self._pending_step is not None:
            self._flush(trainer, "train")

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """Collect validation forwards only when asked, never in the sanity check."""
        collect = "validate" in self._blocks and not trainer.sanity_checking and self.is_attached
        self._block = self._blocks.get("validate") if collect else None
        self._collecting = collect

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int, dataloader_idx: int = 0,
    ) -> None:
        """Close the gate after each validation batch."""
        self._collecting = False

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the validation run's figures under ``val_activations/``."""
        block = self._blocks.get("validate")
        if block is not None and not trainer.sanity_checking and self.is_attached:
            self._figures.log_block(trainer, block, _PREFIXES["validate"], 0, log_step(trainer))

    def detach(self) -> None:
        """Remove the hooks and drop what other callbacks handed over for a step never logged (a fit that raised)."""
        super().detach()
        self._carried, self._pending_step = [], None

    def carry(self, step: int, values: torch.Tensor, figure: ScalarBlock) -> bool:
        """Bring another callback's ``values`` of log step ``step`` (on device) to the host in the step's one transfer.

        Logged as ``figure`` (whose values they become, one per row) with the step's own figures,
        from rank zero (LayerHealth's pull). Returns whether taken: only while ``step`` is collected.
        """
        if self._pending_step != step:
            return False
        self._carried.append((values, figure))
        return True

    def _flush(self, trainer: pl.Trainer, stage: str) -> None:
        step, self._pending_step = self._pending_step, None
        self._gate, self._block, self._grad_scale[0] = False, None, None  # the hooks as the gate's closer left them
        assert step is not None
        order = list(self._forward_order or ())  # once per fit: for LayerHealth and the Layers tab's row order
        carried, self._carried = self._carried, []
        self._figures.log_block(trainer, self._blocks[stage], _PREFIXES[stage], len(self._grad_names(stage)), step,
                                order, carried, self._lookups)
        if order:
            self._forward_order = None
            self._warn_silent(set(order), step)

    def _warn_silent(self, ran: set[str], step: int) -> None:
        """Warn once per fit about selected modules whose hooks did not run in the first logged step."""
        silent = [name for name in self.module_names if name not in ran]
        if silent:
            rank_zero_warn(
                f"ActivationMonitor: {len(silent)} of the {len(self.module_names)} modules selected gave no figures at"
                f" the first logged step ({step}): {short_list(silent, 10)}. Their forward hooks did not run: the"
                " module was not called in that step (an expert not routed, a branch not taken), or the model uses its"
                " weights without calling it (a fused kernel, `F.conv1d(x, conv.weight)`; transformers' Mamba"
                " `conv1d` and `dt_proj`). A fault in such a module is seen only in the modules after it. Select the"
                " modules that run with `modules=` to leave them out.")
