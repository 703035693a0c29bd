"""TransformerStability: the signals that come before a transformer diverges, and a diagnosis in plain words."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hooks.callbacks._base import HookCallback, _log_interval, _validate_interval, claim, log_step
from lightning_hooks.callbacks._stability_hooks import (
    Selection,
    figures,
    register,
    resolve,
    validate_signal,
    warn_no_attention,
)
from lightning_hooks.core._compat import callbacks_of, configure_model_overridden
from lightning_hooks.core._validation import check_int
from lightning_hooks.measure._attention import Sample
from lightning_hooks.output._diagnosis import diagnose, param_groups
from lightning_hooks.output._health_verdicts import JUDGED, Bands, Verdicts
from lightning_hooks.output.figures import Diagnoses, ScalarBlock
from lightning_hooks.output.sinks import log_scalars, log_text

_log = logging.getLogger(__name__)

#: The text tag of the diagnosis, written at the end of fit.
DIAGNOSIS_TAG = "stability/diagnosis"


class TransformerStability(Diagnoses, HookCallback):
    """Log the signals that precede a transformer's divergence, and say in plain words what is wrong and what helps.

    On a logged training step (as Lightning logs: step ``n`` with ``(n + 1) % log_every_n_steps
    == 0``, and step 0; and every step of a ``GradientAnomalyStopping(watch_after=K)`` window),
    on rank zero, hooks read three signals from rank zero's own batches (no collective, no
    reduction across ranks):

    - attention (``attention``): per attention module the largest attention logit
      ``q·k·scale`` and the mean attention entropy (nats) of a sample of query rows, logged as
      ``activations/<module>/attention_max_logit`` and ``.../attention_entropy``. Supported:
      ``nn.MultiheadAttention`` (re-projected from its inputs), Hugging Face GPT-2-style
      attention (split from its ``c_attn`` output) and any module that calls
      ``F.scaled_dot_product_attention`` (read from the call); see
      :mod:`lightning_hooks.measure._attention_sources` for what each honours and
      :class:`~lightning_hooks.measure._attention.Sample` for the cost. An attention module
      that gives no figures at the first logged step (it computes attention itself, or calls a
      fused kernel of its own) is named in a warning, once per fit.
    - output logits (``logits``): the largest ``|logit|`` and the mean log-sum-exp (the
      ``log Z`` that z-loss penalises), as ``activations/<module>/logit_abs_max`` and
      ``.../logit_lse`` (``activations/output/...`` when the model's own output is read).
    - massive activations (``blocks``): per block ``max|x| / median|x|`` of its output hidden
      state and its kurtosis, as ``activations/<block>/massive_ratio`` and ``.../kurtosis``.
      Where a figure is undefined it is neither logged nor judged that step: the ratio of a
      block whose median ``|x|`` is 0 (half its values or more exactly 0: a sparse or ReLU
      output), the kurtosis of a constant one, any figure that comes out NaN.

    Everything is computed on the device; the step's figures come to the host in one transfer
    when its optimizer step is done, go to every logger and to the callbacks that listen
    (:class:`~lightning_hooks.LayerHealth` judges them, the Layers tab draws them), and are
    judged here against the bands below. At the end of fit the diagnosis (:meth:`diagnosis`:
    which layer, which signal, since which step, how far from the band, what usually helps and
    the evidence) is written as TensorBoard text ``stability/diagnosis`` and printed once on
    rank zero (by LayerHealth's summary instead, when a LayerHealth is in ``callbacks``); an
    :class:`~lightning_hooks.AnomalyReport` carries it too.

    Args:
        log_every_n_steps: Read the signals every this many optimizer steps. None: the
            Trainer's ``log_every_n_steps``.
        attention: Attention modules: None (every ``nn.MultiheadAttention`` and every module whose
            class name ends in ``Attention``), a module selection (name globs, types, a
            predicate), or False for none.
        logits: Modules whose output is the logits: None (modules named ``lm_head``, else the
            LightningModule's own output), a module selection, or False.
        blocks: Modules whose output is checked for massive activations: None (the numbered
            block around each attention module: ``h.3`` for ``h.3.attn``), a selection, or False.
        sample_sequences: Sequences of a batch whose attention is recomputed.
        sample_heads: Heads per attention call whose attention is recomputed.
        sample_queries: Query positions per head whose attention is recomputed.
        sample_rows: Logit rows (positions) whose log-sum-exp is taken.
        max_attention_logit: Attention logits grow too large above this.
        min_entropy_fraction: Attention entropy has collapsed below this share of its first
            logged value.
        max_output_logit: Output logits grow too large above this ``|logit|``.
        max_massive_ratio: Massive activations above this ``max|x| / median|x|``.

    Every argument is keyword-only.

    Raises:
        TypeError: If an argument is not of the documented type.
        ValueError: If an argument's value is not as documented; before training, if a
            selection matches no module.

    Example::

        from lightning import Trainer
        from lightning_hooks import LayerHealth, TransformerStability

        trainer = Trainer(callbacks=[TransformerStability(log_every_n_steps=10), LayerHealth()])
    """

    def __init__(self, *, log_every_n_steps: Optional[int] = None, attention: Selection = None,
                 logits: Selection = None, blocks: Selection = None, sample_sequences: int = 2,
                 sample_heads: int = 8, sample_queries: int = 32, sample_rows: int = 1024,
                 max_attention_logit: float = Bands.max_attention_logit,
                 min_entropy_fraction: float = Bands.min_entropy_fraction,
                 max_output_logit: float = Bands.max_output_logit,
                 max_massive_ratio: float = Bands.max_massive_ratio) -> None:
        super().__init__(None)
        _validate_interval(log_every_n_steps)
        for name, selection in (("attention", attention), ("logits", logits), ("blocks", blocks)):
            validate_signal(name, selection)
        for name, value in (("sample_sequences", sample_sequences), ("sample_heads", sample_heads),
                            ("sample_queries", sample_queries), ("sample_rows", sample_rows)):
            check_int(name, value)
        self._bands = Bands(max_attention_logit=max_attention_logit, min_entropy_fraction=min_entropy_fraction,
                            max_output_logit=max_output_logit, max_massive_ratio=max_massive_ratio)
        self.log_every_n_steps, self.attention, self.logits, self.blocks = log_every_n_steps, attention, logits, blocks
        self.sample_sequences, self.sample_heads = sample_sequences, sample_heads
        self.sample_queries, self.sample_rows = sample_queries, sample_rows
        self.max_attention_logit, self.min_entropy_fraction = max_attention_logit, min_entropy_fraction
        self.max_output_logit, self.max_massive_ratio = max_output_logit, max_massive_ratio
        self._sample = Sample(sample_sequences, sample_heads, sample_queries, sample_rows)
        self._every = 1
        self._signals: list[tuple[str, str]] = []  # (signal, name) per target, in registration order
        self._rows: list[tuple[int, Tensor]] = []  # the step's rows on device, by target
        self._pending_step: Optional[int] = None
        self._pending_global = 0
        self._groups: dict[str, str] = {}
        self._warned = False  # about attention modules that gave no figures, once per fit
        self._verdicts = Verdicts(self._bands)

    @property
    def bands(self) -> Bands:
        """The bands this callback judges by."""
        return self._bands

    @property
    def verdicts(self) -> Verdicts:
        """The record of the judged figures: each layer's episodes outside a band, and its first values."""
        return self._verdicts

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the selections (a pattern that matches nothing fails here) and the interval; a fresh record.

        A checkpoint's record, when ``fit`` resumes from one, is loaded after this.
        """
        claim(self, trainer)
        self._every = _log_interval(self.log_every_n_steps, trainer)
        if not configure_model_overridden(pl_module):  # else its layers exist only from on_fit_start
            resolve(pl_module, self.attention, self.logits, self.blocks)
        if stage == "fit":
            self._verdicts, self._groups = Verdicts(self._bands), {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the hooks."""
        super().on_fit_start(trainer, pl_module)
        self._warned = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Note each module's optimizer parameter group (the optimizers exist now), for a diagnosis mid-fit."""
        self._groups = param_groups(trainer, pl_module)

    def attach(self, model: nn.Module) -> None:
        """Register the hooks of every signal on ``model``, replacing any registered before."""
        self.detach()
        found = resolve(model, self.attention, self.logits, self.blocks)
        if self.attention is None and not found["attention"]:
            warn_no_attention([name for name, _ in found["logits"]])
        self._targets = [(name, module) for targets in found.values() for name, module in targets]
        self._signals = [(signal, name) for signal, targets in found.items() for name, _ in targets]
        self._failed.clear()
        self._hook_targets(model)

    def _register_all(self) -> list[RemovableHandle]:
        """Register the hooks of every signal, and return their handles."""
        return [handle for index, ((signal, name), (_, module)) in enumerate(zip(self._signals, self._targets))
                for handle in register(index, signal, name, module, self._add, self._guard, self._sample)]

    def detach(self) -> None:
        """Remove the hooks and drop the step's rows not yet logged (device tensors), on every way out of fit."""
        super().detach()
        self._rows, self._pending_step, self._collecting = [], None, False

    def _add(self, index: int, row: Tensor) -> None:
        self._rows.append((index, row))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Open the gate on logged steps, on rank zero."""
        step = log_step(trainer)
        if self._pending_step is not None and self._pending_step != step:
            self._flush(trainer)
        if trainer.is_global_zero and self.is_attached and self._is_logged(trainer, self._every):
            if self._pending_step is None:
                self._pending_global = trainer.global_step
            self._collecting, self._pending_step = True, step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Close the gate; log the step's figures once its optimizer step is done."""
        self._collecting = False
        if self._pending_step is not None and self._pending_global != trainer.global_step:
            self._flush(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log an unfinished last step; write the diagnosis, and print it unless LayerHealth prints its own."""
        self._collecting = False
        if self._pending_step is not None:
            self._flush(trainer)
        if not trainer.is_global_zero or self._verdicts.last_step is None:
            return
        text = self.diagnosis()
        log_text(trainer, DIAGNOSIS_TAG, "\n".join("    " + line for line in text.splitlines()),
                 self._verdicts.last_step)
        # Another diagnoser (LayerHealth) prints the same diagnosis in its summary.
        if all(cb is self for cb in callbacks_of(trainer, Diagnoses)):
            _log.info(text)

    def _flush(self, trainer: pl.Trainer) -> None:
        step, self._pending_step, self._collecting = self._pending_step, None, False
        rows, self._rows = self._rows, []
        if not rows and step is not None and not self._warned:
            self._warned = True
            rank_zero_warn(f"TransformerStability: read nothing at the first logged step ({step}): none of"
                           f" {sorted(set(self.module_names))} was called in the training step (the model's own"
                           " output is read when training_step calls the model, `self(x)`, not a submodule). Select"
                           " modules that run with `attention=`, `logits=`, `blocks=`.")
        if not rows or step is None:
            return
        if not self._warned:
            self._warn_silent({i for i, _ in rows})
        values = torch.stack([row for _, row in rows]).cpu().numpy().astype(np.float64)  # the one transfer
        blocks = figures([self._signals[i] for i, _ in rows], values)
        log_scalars(trainer, {}, step, figures=blocks)
        self.judge(blocks, step)
        self._groups = param_groups(trainer, trainer.lightning_module)  # the learning rates as they are now

    def _warn_silent(self, seen: set[int]) -> None:
        """Warn once per fit about attention modules that gave no figures at the first logged step."""
        self._warned = True
        silent = [name for i, (signal, name) in enumerate(self._signals) if signal == "attention" and i not in seen]
        if silent:
            rank_zero_warn(
                f"TransformerStability: no attention figures from {silent} at the first logged step: a module"
                " that is neither nn.MultiheadAttention nor GPT-2-style must call F.scaled_dot_product_attention"
                " (not a fused kernel of its own, e.g. flash-attn) and not run under torch.compile. Select the"
                " modules that do with `attention=`, or pass attention=False.")

    def judge(self, blocks: Sequence[ScalarBlock], step: int) -> None:
        """Judge a step's logged figures against the bands, by their typed fields (never the tags)."""
        for block in blocks:
            figure = JUDGED.get((block.kind, block.stat))
            if figure is not None:
                self._verdicts.add(figure, step, dict(zip(block.rows, block.values)))

    def diagnosis(self) -> str:
        """The diagnosis so far: ``healthy``, or per unhealthy layer the signal, since when, how far, what helps."""
        return diagnose(self._verdicts, top_k=5, groups=self._groups)

    def state_dict(self) -> dict[str, Any]:
        """The verdicts so far (episodes, first values, histories) and the parameter groups, for a resumed run."""
        return {"verdicts": self._verdicts.state_dict(), "groups": dict(self._groups)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the verdicts of :meth:`state_dict`."""
        self._verdicts.load_state_dict(state_dict["verdicts"])
        self._groups = dict(state_dict["groups"])
