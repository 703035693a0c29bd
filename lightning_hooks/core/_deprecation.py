"""Renamed and reordered constructor arguments: the old spelling keeps working for one release, with a warning.

:func:`deprecated_arguments` wraps a callback's ``__init__``: an old keyword is passed on under
its new name, and positional arguments in the old order are passed on as keywords, each with a
rank-zero ``LightningDeprecationWarning`` (as Lightning deprecates its own arguments) saying what
to write instead. The wrapped ``__init__`` keeps its signature (``inspect.signature`` follows
``__wrapped__``), so LightningCLI and the docs see only the new names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, TypeVar

from lightning.fabric.utilities.rank_zero import LightningDeprecationWarning
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation

F = TypeVar("F", bound=Callable[..., Any])

#: The release that removes the old spellings.
REMOVED_IN = "0.3.0"

#: ``rank_zero_deprecation``'s ``stacklevel`` that points at the line calling its caller: its own
#: default (5) points at its caller, through Lightning's ``rank_zero_warn`` and ``rank_zero_only``.
_CALLER = 5


def deprecate(message: str, stacklevel: int = _CALLER) -> None:
    """Warn once per call site, on rank zero, with Lightning's ``LightningDeprecationWarning``.

    The category is named, not left to ``rank_zero_deprecation``'s default: that default is a
    global that ``lightning`` and ``pytorch_lightning`` each set to their own class on import.
    ``stacklevel`` is ``rank_zero_deprecation``'s, as seen from the caller of this function.
    """
    rank_zero_deprecation(message, stacklevel=stacklevel + 1, category=LightningDeprecationWarning)


def deprecated_arguments(owner: str, renamed: Optional[Mapping[str, str]] = None,
                         old_order: Sequence[str] = (), positional: int = 0,
                         old_positional: Optional[Callable[[tuple[Any, ...]], bool]] = None,
                         method: bool = True) -> Callable[[F], F]:
    """Wrap ``__init__`` (or a function) so that old argument names and old positional calls still work, with a warning.

    Args:
        owner: The class, for the messages.
        renamed: Old keyword name -> new name.
        old_order: The parameters' order before they became keyword-only, new names.
        positional: How many arguments the new signature takes by position (``modules``: 1).
        old_positional: Whether a call's positional arguments are in the old order though few
            enough for the new signature (e.g. ``GradientAnomalyStopping("skip")``, the old
            first argument being the action); by default only a call with more than
            ``positional`` of them is.
        method: Whether the wrapped function is a method (its first argument, ``self``, is not counted).
    """
    renamed = dict(renamed or {})

    def wrap(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound, args = args[:int(method)], args[int(method):]  # `self`, if any
            if old_order and args and (len(args) > positional or (old_positional is not None and old_positional(args))):
                args, kwargs = (), _by_keyword(owner, old_order, args, kwargs)
            for old, new in renamed.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{owner}: pass `{new}` only; `{old}` is its deprecated name")
                    deprecate(f"{owner}(`{old}=`) is deprecated and will be removed in {REMOVED_IN}:"
                              f" write `{new}=` instead.", stacklevel=_CALLER + 1)
                    kwargs[new] = kwargs.pop(old)
            return function(*bound, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return wrap


def _by_keyword(owner: str, old_order: Sequence[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The positional ``args`` of an old-style call as keywords, with a deprecation warning."""
    if len(args) > len(old_order):
        raise TypeError(f"{owner}() takes at most {len(old_order)} positional arguments, {len(args)} given")
    names = old_order[: len(args)]
    twice = [n for n in names if n in kwargs]
    if twice:
        raise TypeError(f"{owner}() got multiple values for {twice}")
    call = ", ".join(f"{n}={a!r}" for n, a in zip(names, args))
    deprecate(f"{owner}: passing {list(names)} by position is deprecated and will stop working in"
                          f" {REMOVED_IN}: every argument after `modules` is keyword-only; write {owner}({call}).",
                          stacklevel=_CALLER + 2)
    return {**dict(zip(names, args)), **kwargs}


class DeprecatedAttribute:
    """A class attribute under its old name that reads and writes the new one, with a deprecation warning.

    Example::

        class GradientMonitor:
            max_norm = DeprecatedAttribute("max_norm", "norm_threshold")
    """

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def _warn(self, owner: type) -> None:
        deprecate(f"{owner.__name__}.{self.old} is deprecated and will be removed in {REMOVED_IN}:"
                              f" use `{self.new}` instead.", stacklevel=_CALLER + 2)

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self
        self._warn(owner)
        return getattr(instance, self.new)

    def __set__(self, instance: Any, value: Any) -> None:
        self._warn(type(instance))
        setattr(instance, self.new, value)


def renamed_value(owner: str, argument: str, value: Any, renamed: Mapping[str, str], depth: int = 1) -> Any:
    """``value`` under its new name where it was renamed, with a deprecation warning; else ``value`` as is.

    Example::

        renamed_value("FeatureExtractor", "stages", "fit", {"fit": "train"})  # "train", and a warning

    ``depth``: how many calls of the package lie between the user's code and this one (the
    warning points at the user's line).
    """
    if isinstance(value, str) and value in renamed:
        deprecate(f"{owner}(`{argument}={value!r}`) is deprecated and will be removed in {REMOVED_IN}:"
                              f" write `{argument}={renamed[value]!r}` instead.", stacklevel=_CALLER + depth)
        return renamed[value]
    return value
