"""Which modules a callback hooks: module types, name globs, or a predicate."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Sequence
from typing import Union

from torch import nn

ModulePredicate = Callable[[str, nn.Module], bool]
ModuleSelection = Union[None, str, type, ModulePredicate, Sequence[Union[str, type]]]

#: Parameter-free modules selected by default, beside every leaf module that has parameters.
ACTIVATION_TYPES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Softplus,
    nn.Softsign, nn.Softmax, nn.LogSoftmax, nn.GLU,
)


def is_default_module(module: nn.Module) -> bool:
    """Whether the default selection takes ``module``: a leaf with parameters, or an activation."""
    if isinstance(module, ACTIVATION_TYPES):
        return True
    is_leaf = next(module.children(), None) is None
    return is_leaf and next(module.parameters(recurse=False), None) is not None


def validate_selection(selection: ModuleSelection) -> None:
    """Check the shape of a selection before any model is known.

    Raises:
        TypeError: If ``selection`` is not None, a glob string, a module type, a predicate,
            or a sequence of globs and module types.
        ValueError: If ``selection`` is an empty sequence or holds an empty pattern.
    """
    if selection is None or callable(selection) and not isinstance(selection, type):
        return
    items = [selection] if isinstance(selection, (str, type)) else selection
    if not isinstance(items, Sequence):
        raise TypeError(
            "`modules` must be None, a name glob like 'encoder.*', an nn.Module subclass, a"
            f" predicate `(name, module) -> bool`, or a list of globs and types; got {selection!r}"
        )
    if len(items) == 0:
        raise ValueError("`modules` is an empty list: pass None for the default selection")
    for item in items:
        if isinstance(item, str):
            if not item:
                raise ValueError("`modules` holds an empty pattern ''; use a glob such as 'encoder.*'")
        elif not (isinstance(item, type) and issubclass(item, nn.Module)):
            raise TypeError(f"`modules` items must be name globs or nn.Module subclasses, got {item!r}")


def select_modules(root: nn.Module, selection: ModuleSelection) -> list[tuple[str, nn.Module]]:
    """Resolve ``selection`` against ``root`` into ``(qualified_name, module)`` pairs.

    The root module itself is never selected. Each module appears once, in registration order,
    even when several patterns match it.

    Args:
        root: The model, normally the LightningModule itself (never a DDP or FSDP wrapper).
        selection: None for the default (leaf modules with parameters, plus activation
            modules), a name glob (``"encoder.*"``), an ``nn.Module`` subclass, a predicate
            ``(name, module) -> bool``, or a list of globs and subclasses (their union).

    Raises:
        ValueError: If a glob or type matches no module (the message lists close names), or
            the whole selection matches nothing.
    """
    validate_selection(selection)
    named = [(name, module) for name, module in root.named_modules() if name]
    if selection is None:
        chosen = [(n, m) for n, m in named if is_default_module(m)]
    elif callable(selection) and not isinstance(selection, type):
        chosen = [(n, m) for n, m in named if selection(n, m)]
    else:
        items = [selection] if isinstance(selection, (str, type)) else list(selection)
        for item in items:
            if not any(_matches(item, n, m) for n, m in named):
                raise ValueError(_no_match_message(item, [n for n, _ in named]))
        chosen = [(n, m) for n, m in named if any(_matches(item, n, m) for item in items)]
    if not chosen:
        raise ValueError(
            f"`modules`={selection!r} selected no module of {type(root).__name__}."
            f" Available modules: {_short_list([n for n, _ in named])}"
        )
    return chosen


def _matches(item: str | type, name: str, module: nn.Module) -> bool:
    if isinstance(item, str):
        return fnmatch.fnmatchcase(name, item)
    return isinstance(module, item)


def _no_match_message(item: str | type, names: list[str]) -> str:
    if isinstance(item, type):
        return (
            f"`modules` names type {item.__name__}, but the model holds no {item.__name__}."
            f" Available modules: {_short_list(names)}"
        )
    close = difflib.get_close_matches(item, names, n=5, cutoff=0.5)
    hint = f" Did you mean: {', '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"`modules` pattern {item!r} matched no module.{hint}"
        f" Available modules: {_short_list(names)}. Patterns are fnmatch globs over"
        " qualified names, e.g. 'encoder.*' or '*.relu'."
    )


def _short_list(names: list[str], limit: int = 30) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
