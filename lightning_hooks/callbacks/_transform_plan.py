"""GradientTransform's plan: its patterns resolved against a model, and their validation.

:func:`validate_table` checks each pattern-to-number argument when the callback is made;
:func:`resolve_plan` turns the four of them into a :class:`Plan` for one model: the factor of
each scaled parameter (overlapping patterns multiply), the reversal factor of each reversed
module, the parameters under each ``clip_value`` bound (the smallest applies) and the
``clip_norm`` groups, innermost first. How the plan is carried out (hooks, clipping) is in
``transforms``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from torch import nn

from lightning_hooks.core.selection import clean_name, select_modules


class Scaled(NamedTuple):
    """A parameter whose gradient is multiplied by ``factor`` (the product of every pattern over it)."""

    name: str
    param: nn.Parameter
    factor: float


class NormGroup(NamedTuple):
    """The parameters of one ``clip_norm`` module, clipped together to an L2 norm of ``max_norm``."""

    module: str
    params: list[nn.Parameter]
    max_norm: float


@dataclass
class Plan:
    """What a GradientTransform does to one model, resolved from its patterns."""

    scaled: list[Scaled] = field(default_factory=list)
    scaled_at_step: list[Scaled] = field(default_factory=list)
    """Parameters FSDP hands their gradients (no tensor hook fires): scaled in
    ``on_before_optimizer_step``, after accumulation (it is linear). Filled by
    ``GradientTransform.attach``, which sees the model as it trains (sharded or not)."""
    reversed: dict[str, float] = field(default_factory=dict)
    clip_values: dict[float, list[nn.Parameter]] = field(default_factory=dict)
    clip_norms: list[NormGroup] = field(default_factory=list)


def resolve_plan(
    root: nn.Module, scale: Optional[Mapping[str, float]], reverse: Optional[Mapping[str, float]],
    clip_value: Optional[Mapping[str, float]], clip_norm: Optional[Mapping[str, float]],
) -> Plan:
    """Resolve a GradientTransform's patterns against ``root`` into what it does to each module and parameter.

    Args:
        root: The model the patterns name modules of.
        scale: Pattern to gradient factor, as GradientTransform takes it; None for none.
        reverse: Pattern to reversal scale; None for none.
        clip_value: Pattern to element bound; None for none.
        clip_norm: Pattern to max norm; None for none.

    Returns:
        The plan: overlapping patterns merged, ``clip_norm`` groups innermost first.

    Raises:
        ValueError: If a pattern matches no module (the message lists close names), or a
            ``reverse`` pattern selects more than one module.
    """
    plan = Plan()
    if scale:
        factors = _combine(root, "scale", scale, lambda a, b: a * b)
        plan.scaled = [Scaled(name, p, f) for p, (name, f) in factors.items()]
    for pattern, value in (reverse or {}).items():
        selected = _outermost(root, "reverse", pattern)
        if len(selected) != 1:
            raise ValueError(
                f"`reverse` pattern {pattern!r} selects {len(selected)} modules"
                f" ({', '.join(repr(n) for n, _ in selected[:5])}); a reversal flips everything"
                " upstream, so a chain of them cancels out. Name the single module whose output"
                " the gradient should be reversed at, e.g. the whole block or an nn.Identity."
            )
        name = selected[0][0]
        plan.reversed[name] = plan.reversed.get(name, 1.0) * -value
    if clip_value:
        bounds = _combine(root, "clip_value", clip_value, min)
        for p, (_, bound) in bounds.items():
            plan.clip_values.setdefault(bound, []).append(p)
    if clip_norm:
        plan.clip_norms = _norm_groups(root, clip_norm)
    return plan


def validate_table(arg: str, table: Any, positive: bool) -> None:
    """Check one of GradientTransform's arguments: a non-empty mapping of globs to finite numbers.

    Args:
        arg: The argument's name, for the messages (``"scale"``).
        table: Its value.
        positive: Whether the numbers must also be positive.

    Raises:
        TypeError: If ``table`` is not a mapping, a key not a non-empty string, or a value not a number.
        ValueError: If ``table`` is empty, or a value not finite (or, with ``positive``, not positive).
    """
    if not isinstance(table, Mapping):
        raise TypeError(f"`{arg}` must be a dict of name patterns to numbers, got {table!r}")
    if not table:
        raise ValueError(f"`{arg}` is empty: pass None, or a dict like {{'backbone.*': 0.1}}")
    for pattern, value in table.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"`{arg}` keys must be non-empty name globs like 'backbone.*', got {pattern!r}")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"`{arg}` values must be finite numbers, got {value!r} ({type(value).__name__})"
                            f" for {pattern!r}: pass e.g. {{{pattern!r}: 0.1}}")
        if not math.isfinite(value):
            raise ValueError(f"`{arg}` values must be finite numbers, got {value!r} for {pattern!r}")
        if positive and value <= 0:
            raise ValueError(f"`{arg}` values must be positive, got {value!r} for {pattern!r}")


def _outermost(root: nn.Module, arg: str, pattern: str) -> list[tuple[str, nn.Module]]:
    """Return the modules ``pattern`` matches that are not inside another module it matches."""
    matched = select_modules(root, pattern, argument=arg)
    names = {name for name, _ in matched}
    return [(name, m) for name, m in matched if not any(a in names for a in _ancestors(name))]


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _trainable(root: nn.Module, arg: str, pattern: str, frozen: bool = False) -> dict[nn.Parameter, str]:
    """Parameters under the modules ``pattern`` selects, once each, with a qualified name.

    Only those that require grad, unless ``frozen`` (UpdateTransform: a frozen parameter may be
    unfrozen later in the fit).
    """
    found: dict[nn.Parameter, str] = {}
    for module_name, module in _outermost(root, arg, pattern):
        for param_name, param in module.named_parameters():
            if frozen or param.requires_grad:
                found.setdefault(param, f"{module_name}.{clean_name(param_name)}")
    return found


def _combine(
    root: nn.Module, arg: str, table: Mapping[str, float], merge: Any, frozen: bool = False
) -> dict[nn.Parameter, tuple[str, float]]:
    """Each parameter's value, merging the values of every pattern that reaches it (``frozen``: as ``_trainable``)."""
    combined: dict[nn.Parameter, tuple[str, float]] = {}
    for pattern, value in table.items():
        for param, name in _trainable(root, arg, pattern, frozen).items():
            combined[param] = (name, merge(combined[param][1], value)) if param in combined else (name, value)
    return combined


def _norm_groups(root: nn.Module, table: Mapping[str, float]) -> list[NormGroup]:
    """One group per outermost module each pattern matches, the innermost groups first."""
    bounds: dict[str, float] = {}
    modules: dict[str, nn.Module] = {}
    for pattern, value in table.items():
        for name, module in _outermost(root, "clip_norm", pattern):
            bounds[name] = min(value, bounds.get(name, value))
            modules[name] = module
    ordered = sorted(bounds, key=lambda name: -name.count("."))
    groups = [NormGroup(n, [p for p in modules[n].parameters() if p.requires_grad], bounds[n]) for n in ordered]
    return [group for group in groups if group.params]
