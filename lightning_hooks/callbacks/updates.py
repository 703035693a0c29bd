"""UpdateTransform: change the update each optimizer step makes, per module, for any optimizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import lightning.pytorch as pl
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hooks.callbacks._base import HookCallback
from lightning_hooks.callbacks._transform_plan import validate_table
from lightning_hooks.callbacks._update_plan import UpdatePlan, resolve_update_plan
from lightning_hooks.callbacks._update_step import NormHistory, StepRewrite
from lightning_hooks.core._compat import configure_model_overridden
from lightning_hooks.core._validation import check_int, check_number


class UpdateTransform(HookCallback):
    """Scale, cap or clip the update ``Δw = w_after - w_before`` of chosen modules' parameters at every optimizer step.

    :class:`~lightning_hooks.GradientTransform` changes gradients, which changes the update only
    for plain SGD: Adam, AdamW, Adagrad, RMSprop, Lion, Adafactor divide the gradient by their
    own running scale, so a scaled gradient gives the same update. This callback acts on the
    update itself, after the optimizer made it, so it means the same thing for every optimizer:

    * ``scale``: ``Δw`` becomes ``factor * Δw``. For SGD (with or without momentum), Adam and
      AdamW (its decoupled weight decay included) the update is proportional to the learning
      rate and the optimizer's state does not depend on it, so this is exactly a per-layer
      learning-rate multiplier: the run equals the one with that param group's ``lr`` multiplied,
      to float rounding. (Where the state depends on the step taken, as LBFGS's curvature
      pairs do, it is a scaled step, not a different learning rate.)
    * ``max_ratio``: ``||Δw|| / ||w_before||`` of each parameter is capped at the value
      (a LARS/LAMB-style trust bound, on any optimizer), after ``scale``. A parameter that is
      all zeros before the step has no ratio and is not capped.
    * ``clip_to_history``: each pattern makes one group of parameters whose joint update norm
      (after ``scale`` and ``max_ratio``) is clipped to ``mean + history_sigmas * std`` of the
      group's last ``history_window`` norms, once half the window is filled (as Levanter's
      ``clip_update_by_historical_norm``, whose defaults are 128 steps and 3 standard
      deviations; its history keeps the norms before clipping, as here). ``"*"`` clips the
      whole model's update, as Levanter does.

    How: an optimizer step pre-hook copies the selected parameters (this rank's shards) on their
    device, the one copy a step holds; the step post-hook works out one factor per parameter on
    the device and moves each parameter to ``w_before + factor * Δw``. No figure leaves the
    device. The hooks go on at ``on_fit_start``, before any other callback's step hooks that go on
    later (so GradientMonitor's update ratios measure the changed update), and come off on every
    way out.

    Training loops this follows: gradient accumulation (the optimizer steps once per
    accumulation); AMP (a step the GradScaler skips never calls the optimizer, so nothing
    happens); DDP (every rank rewrites its identical update identically); FSDP2 and FSDP1 shards
    (the norms of the whole parameters are summed over the shards in one collective per step,
    only when ``max_ratio`` or ``clip_to_history`` needs them); LBFGS (its whole step, all its
    closure evaluations, is one update); manual optimization (``opt.step()``); parameters
    unfrozen or param groups added during the fit (Lightning's ``BackboneFinetuning``: patterns
    reach frozen parameters too, and an optimizer's plan is made again when its param groups
    change); and
    :class:`~lightning_hooks.GradientAnomalyStopping`: an update it drops (every gradient None)
    is left alone and not remembered, and its rollback restores parameters and optimizer as
    they were, and the norm history as it was at its snapshot (the norms of the discarded
    updates go with them). The norm history is saved in checkpoints (``state_dict``).

    Every argument is keyword-only.

    Args:
        scale: Pattern to factor multiplying the update of the selected parameters
            (``{"backbone.*": 0.1}``); overlapping patterns multiply; 0 freezes.
        max_ratio: Pattern to the largest ``||Δw|| / ||w_before||`` of each selected
            parameter; the smallest of overlapping patterns applies.
        clip_to_history: A pattern, or several (one group each, reaching disjoint parameters),
            whose update norm is clipped against its own history.
        history_window: How many past norms the history holds (at least 2).
        history_sigmas: How many standard deviations above the mean a norm may go.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If no transform is given, a table is empty or holds a non-finite number (or,
            for ``max_ratio``, a non-positive one), ``history_window`` is below 2 or
            ``history_sigmas`` not positive; in ``setup``, if a pattern matches no module (the
            message lists close names) or two ``clip_to_history`` patterns reach one parameter.

    Example::

        # Fine-tune under AdamW with the backbone learning 10x slower than the head,
        # and no update of any layer above 1% of its weights.
        transform = UpdateTransform(scale={"backbone.*": 0.1}, max_ratio={"*": 0.01})
        trainer = pl.Trainer(callbacks=[transform])

    """

    def __init__(
        self,
        *,
        scale: Optional[Mapping[str, float]] = None,
        max_ratio: Optional[Mapping[str, float]] = None,
        clip_to_history: Optional[Union[str, Sequence[str]]] = None,
        history_window: int = 128,
        history_sigmas: float = 3.0,
    ) -> None:
        if scale is None and max_ratio is None and clip_to_history is None:
            raise ValueError("UpdateTransform needs at least one of `scale`, `max_ratio`, `clip_to_history`,"
                             " e.g. `scale={'backbone.*': 0.1}`")
        if scale is not None:
            validate_table("scale", scale, positive=False)
        if max_ratio is not None:
            validate_table("max_ratio", max_ratio, positive=True)
        groups = _validate_groups(clip_to_history)
        check_int("history_window", history_window, low=2)
        check_number("history_sigmas", history_sigmas, low=0.0)
        self.scale = dict(scale) if scale is not None else None
        self.max_ratio = dict(max_ratio) if max_ratio is not None else None
        self.clip_to_history = groups
        self.history_window, self.history_sigmas = history_window, history_sigmas
        patterns = {*(self.scale or {}), *(self.max_ratio or {}), *(groups or ())}
        super().__init__(modules=sorted(patterns))
        self._plan: Optional[UpdatePlan] = None
        self._rewrite = StepRewrite(history_window, history_sigmas)
        self._state_key: Optional[str] = None

    @property
    def state_key(self) -> str:
        """Identifies this instance's state in a checkpoint, so several can be used in one Trainer.

        Made once from the arguments: Lightning reads it at every hook call, for its profiler's labels.
        """
        if self._state_key is None:
            self._state_key = self._generate_state_key(
                scale=self.scale, max_ratio=self.max_ratio, clip_to_history=self.clip_to_history,
                history_window=self.history_window, history_sigmas=self.history_sigmas)
        return self._state_key

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve every pattern, so a typo fails before training (``configure_model``: at fit start)."""
        if not configure_model_overridden(pl_module):
            self._plan = self._resolve(pl_module)
        super().setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resolve the plan against the model as it trains, and put the step hooks on its optimizers."""
        super().on_fit_start(trainer, pl_module)
        assert self._plan is not None
        for index, optimizer in enumerate(trainer.optimizers):  # every one: a param group may come later
            self._rewrite.add(index, optimizer, self._plan.for_optimizer)
            self._handles += [optimizer.register_step_pre_hook(self._rewrite.before_step),
                              optimizer.register_step_post_hook(self._rewrite.after_step)]

    def attach(self, model: nn.Module) -> None:
        """Resolve the plan against ``model`` (no module hook: the work is done at the optimizer's step)."""
        self._plan = self._resolve(model)
        super().attach(model)

    def detach(self) -> None:
        """Remove the step hooks; drop any snapshot."""
        super().detach()
        self._rewrite.forget()

    def _register(self, index: int, name: str, module: nn.Module) -> list[RemovableHandle]:
        return []

    def state_dict(self) -> dict[str, Any]:
        """Return the update-norm history of each optimizer (by its index in the trainer)."""
        return {"histories": {index: history.state_dict() for index, history in self._rewrite.histories.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back the histories :meth:`state_dict` gave."""
        for index, state in state_dict.get("histories", {}).items():
            history = NormHistory(len(self.clip_to_history or ()), self.history_window, self.history_sigmas)
            history.load_state_dict(state)
            self._rewrite.histories[int(index)] = history

    def copy_judges(self) -> dict[int, tuple[Optional[Tensor], int]]:
        """Copies of the norm histories (on their device), for GradientAnomalyStopping's rollback snapshot."""
        return {index: (None if h.norms is None else h.norms.clone(), h.index)
                for index, h in self._rewrite.histories.items()}

    def restore_judges(self, judges: dict[int, tuple[Optional[Tensor], int]]) -> None:
        """Put back a :meth:`copy_judges` at a rollback (a history begun since starts afresh)."""
        for index, history in self._rewrite.histories.items():
            norms, history.index = judges.get(index, (None, 0))
            history.norms = None if norms is None else norms.clone()  # the snapshot stays untouched

    def _resolve(self, root: nn.Module) -> UpdatePlan:
        return resolve_update_plan(root, self.scale, self.max_ratio, self.clip_to_history)


def _validate_groups(groups: Any) -> Optional[list[str]]:
    """``clip_to_history`` as a list of patterns (a single string is one pattern)."""
    if groups is None:
        return None
    listed = [groups] if isinstance(groups, str) else groups
    if not isinstance(listed, Sequence) or not listed:
        raise (TypeError if not isinstance(listed, Sequence) else ValueError)(
            f"`clip_to_history` must be a name glob or a non-empty list of them, got {groups!r}:"
            " pass e.g. clip_to_history='*' (the whole model) or ['encoder.*', 'decoder.*']")
    for pattern in listed:
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"`clip_to_history` patterns must be non-empty name globs like 'encoder.*',"
                            f" got {pattern!r}")
    return list(listed)
