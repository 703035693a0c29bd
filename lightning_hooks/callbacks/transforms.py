"""GradientTransform: per-module gradient scaling, reversal and clipping through hooks.

Here is the callback's lifecycle and what carries its plan out: the tensor hooks that scale,
the forward hooks that place a reversal, the clipping at the optimizer step. How the patterns
become that plan for one model (and how they are validated) is in ``_transform_plan``.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_hooks.callbacks._base import HookCallback, claim
from lightning_hooks.callbacks._transform_plan import Plan, Scaled, resolve_plan, validate_table
from lightning_hooks.core._compat import configure_model_overridden
from lightning_hooks.core._torch_internals import is_view
from lightning_hooks.measure._sharding import (
    ShardGroupCache,
    ShardGroups,
    grad_of,
    local,
    note_flat_shards,
    takes_gradient_directly,
)
from lightning_hooks.measure.anomalies import gradient_figures


class GradientTransform(HookCallback):
    """Scale, reverse or clip the gradients of chosen modules, every training step.

    Every argument maps fnmatch globs over qualified module names (``"backbone.*"``,
    ``"head"``) to a number. A pattern selects the modules it matches *and everything inside
    them*, and it acts once on each parameter it reaches, however many nested modules it matches.

    Mechanisms, and why:

    * ``scale``: a tensor hook on each parameter (``param.register_hook``) multiplies the
      gradient of that parameter by the factor, before it is accumulated into ``.grad``. It
      scales the *gradient*, which scales the update only under plain SGD: Adam, AdamW, Adagrad,
      RMSprop, Lion and their kin divide the gradient by their own running scale, so the update
      stays as it was (up to ``eps``); a warning says so once per fit. To make a layer learn
      slower under any optimizer, scale its update with :class:`~lightning_hooks.UpdateTransform`. Only
      the parameters' own gradients change; the gradient flowing on to earlier layers does not.
      (A parameter shared with an unselected module has one gradient: it is scaled too.)
      FSDP (FSDP2's DTensors, FSDP1's flat views) hands its parameters their gradients
      directly, so no tensor hook on them fires: their gradients are scaled in
      ``on_before_optimizer_step`` instead, after accumulation (the same result, as scaling is linear).
      Tensor hooks work with in-place ops and any output structure, unlike
      ``register_full_backward_hook``, which raises on in-place ops (``ReLU(inplace=True)``,
      ``x += shortcut``) and never fires for modules returning lists or dicts.
    * ``reverse``: a gradient reversal layer placed *after* the selected module. A forward
      hook puts a tensor hook returning ``-scale * grad`` on each output tensor, so the
      module's own parameters and everything upstream of it receive the reversed gradient;
      modules downstream, and other consumers of the module's *input*, do not. Outputs that
      are an input returned as is (``nn.Identity``, in-place modules) or a view are replaced
      by a copy first, so the reversal holds for them too, and survives later in-place ops
      such as ``x += shortcut``. For domain adaptation put the reversal on the domain branch only,
      e.g. an ``nn.Identity`` in front of the domain classifier: a reversal on a module whose
      output also feeds the task head flips the task gradient too. Each ``reverse`` pattern
      must select exactly one module, since a chain of reversals cancels out.
    * ``clip_value`` / ``clip_norm``: applied to ``.grad`` in ``on_before_optimizer_step``,
      i.e. to exactly the gradient the optimizer is about to use: after gradient
      accumulation, after the DDP all-reduce and after AMP unscaling (clipping inside backward
      would clip the loss-scaled, per-micro-batch, per-rank gradient instead). ``clip_value``
      clamps each gradient element to ``[-v, v]``; ``clip_norm`` rescales the parameters
      under each selected module jointly so their total L2 norm is at most the value
      (``torch.nn.utils.clip_grad_norm_``). A ``clip_norm`` pattern makes one group per
      outermost module it matches (``"blocks.*"``: one group per block). This runs before the
      LightningModule's own ``on_before_optimizer_step`` and before Lightning's
      ``gradient_clip_val``; only the parameters of the optimizer being stepped are touched.
      With sharded gradients (FSDP2's DTensors, FSDP1's flat shards) ``clip_norm`` clips by the
      norm of the whole gradients, summed over the shards in one collective per group, the same on every rank.

    Gradient accumulation and DDP: the ``scale`` and ``reverse`` hooks run on every backward,
    on each rank's local gradient, before DDP averages it. Both are linear, so the accumulated
    and averaged gradient is transformed exactly as if the hooks ran once at the end (and AMP
    loss scaling commutes with them too).

    Overlapping patterns: ``scale`` factors multiply; ``reverse`` factors compose (two
    reversals on one path cancel); the smallest ``clip_value`` applies; nested ``clip_norm``
    groups are clipped innermost first, so every group ends within its bound.

    Hooks go on at ``on_fit_start`` and come off on every way out, like every
    :class:`~lightning_hooks.callbacks._base.HookCallback`; they are not gated, so they act on every
    step. Parameters that do not require grad when fit starts are left alone.

    Every argument is keyword-only.

    Args:
        scale: Pattern to factor multiplying the gradients of the selected parameters
            (e.g. ``{"backbone.*": 0.1}``; 0 stops their gradients, a negative factor flips them).
            Their updates follow only under SGD; see :class:`~lightning_hooks.UpdateTransform`.
        reverse: Pattern to positive ``scale``: the gradient flowing back through the
            selected module's output is multiplied by ``-scale``.
        clip_value: Pattern to positive bound ``v``: gradient elements are clamped to ``[-v, v]``.
        clip_norm: Pattern to positive max norm of each selected module's parameter gradients.

    Raises:
        TypeError: If an argument is not a mapping of strings to numbers.
        ValueError: If no argument is given, one is empty, holds an empty pattern, a
            non-finite number, or a non-positive ``reverse``/``clip`` value; in ``setup``, if a
            pattern matches no module (the message lists close names) or a ``reverse``
            pattern selects more than one module.

    Example::

        class DANN(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.features = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
                self.label_head = nn.Linear(64, 10)
                self.grl = nn.Identity()  # the domain branch starts here
                self.domain_head = nn.Linear(64, 2)

        transform = GradientTransform(
            scale={"features.0": 0.1}, reverse={"grl": 1.0}, clip_norm={"domain_head": 1.0}
        )
        trainer = pl.Trainer(callbacks=[transform])

    """

    # Its hooks change every step's gradients.
    _hooks_follow_gate = False

    def __init__(
        self,
        *,
        scale: Optional[Mapping[str, float]] = None,
        reverse: Optional[Mapping[str, float]] = None,
        clip_value: Optional[Mapping[str, float]] = None,
        clip_norm: Optional[Mapping[str, float]] = None,
    ) -> None:
        tables = {"scale": scale, "reverse": reverse, "clip_value": clip_value, "clip_norm": clip_norm}
        if all(table is None for table in tables.values()):
            raise ValueError(
                "GradientTransform needs at least one of `scale`, `reverse`, `clip_value`, `clip_norm`,"
                " e.g. `scale={'backbone.*': 0.1}`"
            )
        for arg, table in tables.items():
            if table is not None:
                validate_table(arg, table, positive=arg != "scale")
        self.scale = dict(scale) if scale is not None else None
        self.reverse = dict(reverse) if reverse is not None else None
        self.clip_value = dict(clip_value) if clip_value is not None else None
        self.clip_norm = dict(clip_norm) if clip_norm is not None else None
        patterns = {p for table in tables.values() if table is not None for p in table}
        super().__init__(modules=sorted(patterns))
        self._plan: Optional[Plan] = None
        self._shard_groups = ShardGroupCache()  # of each clip_norm group's gradients

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve every pattern, so a typo or an ambiguous reversal fails before training.

        As in the base class, a model built in ``configure_model`` is resolved in ``on_fit_start``.
        """
        claim(self, trainer)
        if not configure_model_overridden(pl_module):
            self._plan = self._resolve(pl_module)
        super().setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the hooks; warn once if ``scale`` meets an optimizer whose update does not follow the gradient."""
        super().on_fit_start(trainer, pl_module)
        if self._plan is not None and self._plan.scaled:
            warn_if_scale_is_normalised_away(trainer.optimizers, self._plan.scaled)

    def attach(self, model: nn.Module) -> None:
        """Register the reversal hooks on modules and the scaling hooks on parameters."""
        self._plan = self._resolve(model)
        self._shard_groups.clear()
        note_flat_shards(model, type(self).__name__)
        super().attach(model)
        # Not wrapped in `_guard`: a hook that changes training must fail loudly, never be
        # switched off while the run goes on with other gradients (or other ranks' gradients).
        for scaled in self._plan.scaled:
            if takes_gradient_directly(scaled.param):  # under FSDP no tensor hook on the parameter fires
                self._plan.scaled_at_step.append(scaled)
            else:
                self._handles.append(scaled.param.register_hook(partial(_multiply, factor=scaled.factor)))

    def _register(self, index: int, name: str, module: nn.Module) -> list[RemovableHandle]:
        factor = self._plan.reversed.get(name) if self._plan is not None else None
        if factor is None:
            return []
        return [module.register_forward_hook(partial(_reverse_outputs, factor=factor), with_kwargs=True)]

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        """Scale sharded gradients, then clip the accumulated, all-reduced, unscaled gradients."""
        plan = self._plan
        if plan is None or not (plan.clip_values or plan.clip_norms or plan.scaled_at_step):
            return
        stepped = {p for group in optimizer.param_groups for p in group["params"]}
        for _, param, factor in plan.scaled_at_step:
            if param in stepped and param.grad is not None:
                local(param.grad).mul_(factor)
        for bound, params in plan.clip_values.items():
            grads = [local(p.grad) for p in params if p in stepped and p.grad is not None]
            if grads:  # as nn.utils.clip_grad_value_, on this rank's shards
                torch._foreach_clamp_min_(grads, -bound)
                torch._foreach_clamp_max_(grads, bound)
        for norm_group in plan.clip_norms:
            with_grad = [p for p in norm_group.params if p in stepped and grad_of(p) is not None]
            if with_grad:
                _clip_norm_(with_grad, norm_group.max_norm, self._shard_groups(with_grad))

    def _resolve(self, root: nn.Module) -> Plan:
        return resolve_plan(root, self.scale, self.reverse, self.clip_value, self.clip_norm)


#: Optimizers whose update is the learning rate times a linear function of the gradient (and of the
#: weights, with weight decay): a scaled gradient scales the gradient's part of the update.
_FOLLOWS_GRADIENT = (torch.optim.SGD, torch.optim.ASGD)


def warn_if_scale_is_normalised_away(optimizers: list[Optimizer], scaled: list[Scaled]) -> None:
    """Warn (rank zero) when an optimizer that steps a scaled parameter does not scale its update with the gradient.

    Adam-family optimizers, Adagrad, RMSprop, Rprop, LBFGS, and any optimizer not known to
    follow the gradient linearly (Lion, Adafactor, ...): naming them one by one would miss the next one.
    """
    params = {s.param for s in scaled if s.factor != 1.0}
    for optimizer in optimizers:
        if isinstance(optimizer, _FOLLOWS_GRADIENT):
            continue
        if any(p in params for group in optimizer.param_groups for p in group["params"]):
            name = type(optimizer).__name__
            rank_zero_warn(
                f"GradientTransform: `scale` multiplies gradients, but {name} does not scale its update with the"
                f" gradient (it divides by its own running scale, or is not known to follow it), so the scaled"
                f" parameters learn about as fast as before. To scale their updates under {name}, use"
                " `UpdateTransform(scale={...})` instead (exactly a per-layer learning-rate multiplier).",
                category=UserWarning,
            )
            return


def _clip_norm_(params: list[Tensor], max_norm: float, shards: ShardGroups) -> None:
    """``nn.utils.clip_grad_norm_``, by the norm of the whole gradients when they are sharded.

    A sharded group's norm is summed over its shards in one collective (the same on every
    rank, so every rank scales by the same factor); the local shards are scaled.
    """
    if not shards.sharded:
        nn.utils.clip_grad_norm_(params, max_norm)
        return
    grads: list[Tensor] = [grad_of(p) for p in params]  # type: ignore[misc]
    total = gradient_figures(grads, [len(grads)], exact=False, shards=shards).group_norms[-1]
    factor = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        local(grad).mul_(factor.to(grad.dtype))


def _multiply(grad: Tensor, factor: float) -> Tensor:
    return grad * factor


def _reverse_outputs(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, factor: float
) -> Any:
    """Forward hook: make the gradient reaching each output tensor be multiplied by ``factor``."""
    if not torch.is_grad_enabled():
        return None
    inputs = [value for value in (*args, *kwargs.values()) if isinstance(value, Tensor)]

    def reverse(tensor: Tensor) -> Tensor:
        if not tensor.requires_grad:
            return tensor
        # A hook on an input returned as is (nn.Identity, in-place modules) would reverse the
        # input's other consumers too, and one on a view is bypassed once the view is modified
        # in place: both get a copy of their own.
        if is_view(tensor) or any(tensor is value for value in inputs):
            tensor = tensor.clone()
        tensor.register_hook(partial(_multiply, factor=factor))
        return tensor

    return apply_to_collection(output, Tensor, reverse)
