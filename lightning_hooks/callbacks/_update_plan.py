"""UpdateTransform's plan: its patterns resolved against a model, one entry per parameter they reach.

The per-parameter numbers live in device tensors built once per optimizer (:meth:`UpdatePlan.for_optimizer`),
so that a step reads them without any Python work per parameter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_hooks.callbacks._transform_plan import _combine, _trainable


@dataclass
class OptimizerPlan:
    """The plan's parameters that one optimizer steps, with their numbers as tensors on their device.

    ``scales`` is None when only the scale is changed (then ``scale_list`` is all that is needed,
    and no norm is measured); ``groups`` holds each parameter's history group, -1 for none.
    """

    params: list[nn.Parameter]
    scale_list: list[float]
    scales: Optional[Tensor] = None
    max_ratios: Optional[Tensor] = None
    groups: Optional[Tensor] = None
    group_count: int = 0


@dataclass
class UpdatePlan:
    """What an UpdateTransform does to one model's parameters: a factor, a cap, a history group each."""

    params: list[nn.Parameter] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    max_ratios: list[float] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    group_names: list[str] = field(default_factory=list)

    @property
    def measures(self) -> bool:
        """Whether a step needs the norms (a cap or a history), not only the scale."""
        return bool(self.group_names) or any(math.isfinite(r) for r in self.max_ratios)

    def for_optimizer(self, optimizer: Any) -> Optional[OptimizerPlan]:
        """The part of the plan ``optimizer`` steps, in the plan's order; None if it steps none of it."""
        stepped = {p for group in optimizer.param_groups for p in group["params"]}
        chosen = [i for i, p in enumerate(self.params) if p in stepped]
        if not chosen:
            return None
        params = [self.params[i] for i in chosen]
        part = OptimizerPlan(params, [self.scales[i] for i in chosen], group_count=len(self.group_names))
        if self.measures:
            device = params[0].device

            def numbers(values: Sequence[float], dtype: torch.dtype = torch.float32) -> Tensor:
                return torch.tensor([values[i] for i in chosen], dtype=dtype, device=device)

            part.scales, part.max_ratios = numbers(self.scales), numbers(self.max_ratios)
            part.groups = numbers(self.groups, torch.long)
        return part


def resolve_update_plan(
    root: nn.Module, scale: Optional[Mapping[str, float]], max_ratio: Optional[Mapping[str, float]],
    clip_to_history: Optional[Sequence[str]],
) -> UpdatePlan:
    """Resolve an UpdateTransform's patterns against ``root``.

    Args:
        root: The model the patterns name modules of.
        scale: Pattern to update factor (overlapping patterns multiply); None for none.
        max_ratio: Pattern to the largest ``||Δw|| / ||w||`` (the smallest of overlapping ones
            applies); None for none.
        clip_to_history: Patterns, each one group of parameters whose joint update norm is
            clipped against its own history; None for none.

    Returns:
        The plan, its parameters in the order the model lists them.

    Raises:
        ValueError: If a pattern matches no module (the message lists close names), or a
            parameter falls in two ``clip_to_history`` groups.
    """
    # Frozen parameters too: one unfrozen later (BackboneFinetuning) is transformed from then on.
    scales = _combine(root, "scale", scale, lambda a, b: a * b, frozen=True) if scale else {}
    ratios = _combine(root, "max_ratio", max_ratio, min, frozen=True) if max_ratio else {}
    groups: dict[nn.Parameter, int] = {}
    patterns = list(clip_to_history or ())
    for index, pattern in enumerate(patterns):
        for param in _trainable(root, "clip_to_history", pattern, frozen=True):
            if param in groups:
                raise ValueError(
                    f"`clip_to_history` patterns {patterns[groups[param]]!r} and {pattern!r} both reach"
                    " a parameter: each parameter's update is clipped in one group; make the patterns disjoint"
                )
            groups[param] = index
    plan = UpdatePlan(group_names=patterns)
    for name, param in root.named_parameters():
        if param in scales or param in ratios or param in groups:
            plan.params.append(param)
            plan.names.append(name)
            plan.scales.append(scales[param][1] if param in scales else 1.0)
            plan.max_ratios.append(ratios[param][1] if param in ratios else math.inf)
            plan.groups.append(groups.get(param, -1))
    if not plan.measures:  # a factor of 1 alone changes nothing: leave those parameters out
        keep = [i for i, s in enumerate(plan.scales) if s != 1.0]
        plan.params, plan.names = [plan.params[i] for i in keep], [plan.names[i] for i in keep]
        plan.scales, plan.max_ratios = [plan.scales[i] for i in keep], [plan.max_ratios[i] for i in keep]
        plan.groups = [plan.groups[i] for i in keep]
    return plan
