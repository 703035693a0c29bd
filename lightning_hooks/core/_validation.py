"""Constructor argument checks, in one place: every callback raises the same errors with the same messages.

A value of the wrong type raises ``TypeError``, a value of the right type outside what is
allowed raises ``ValueError``; each message names the argument, says what it got (value and
type), what it expects and how to fix it. Pure Python (no torch): the Layers tab, which
TensorBoard loads without torch, validates its thresholds with it too.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Collection
from typing import Any, Optional


def _got(value: Any) -> str:
    """``value`` as a message shows it: its repr and its type."""
    return f"got {value!r} ({type(value).__name__})"


def check_bool(name: str, value: Any) -> None:
    """Raise ``TypeError`` unless ``value`` is ``True`` or ``False`` (not 0/1, not a string).

    Example::

        check_bool("histogram", "yes")  # TypeError: `histogram` must be a bool, got 'yes' (str): pass ...
    """
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, {_got(value)}: pass {name}=True or {name}=False")


#: The longest window (steps, or logged norms) a running median or a history may cover: far
#: beyond any training's need, and small enough that its buffer fits in memory.
MAX_WINDOW = 100_000


def check_int(name: str, value: Any, low: int = 1, optional: bool = False, none_means: str = "",
              high: Optional[int] = None) -> None:
    """Check an int argument of at least ``low`` (a bool is not an int here); None too where ``optional``.

    Args:
        name: The argument's name, for the message.
        value: What was passed.
        low: The smallest value allowed.
        optional: Whether None is allowed.
        none_means: What None means, for the message (``"no limit"``: "or None for no limit").
        high: The largest value allowed, if any (a size that must fit in memory).

    Raises:
        TypeError: If ``value`` is not an int (or None, where allowed).
        ValueError: If it is below ``low`` or above ``high``.
    """
    if optional and value is None:
        return
    if high is not None and isinstance(value, int) and not isinstance(value, bool) and value > high:
        # repr of a huge int is long, or refused past 4300 digits: say its size instead
        shown = f"{value!r}" if value < 10**12 else f"an int of about {int(value.bit_length() * 0.30103) + 1} digits"
        raise ValueError(f"`{name}` must be at most {high}, got {shown}: pass {name}={high} or less")
    kind = {1: "a positive int", 0: "a non-negative int"}.get(low, f"an int of at least {low}")
    expected = f"{kind}, or None for {none_means}" if optional and none_means else (
        f"{kind} or None" if optional else kind)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be {expected}, {_got(value)}: pass e.g. {name}={max(low, 1)}")
    if value < low:
        raise ValueError(f"`{name}` must be {expected}, got {value!r}: pass {name}={low} or more")


def check_number(name: str, value: Any, low: float, strict: bool = True, high: Optional[float] = None,
                 optional: bool = False) -> None:
    """Check a finite real number above ``low`` (or at least, without ``strict``), at most ``high``.

    Args:
        name: The argument's name, for the message.
        value: What was passed: an int or a float, not a bool.
        low: The bound below.
        strict: Whether ``value`` must be above ``low`` rather than at least ``low``.
        high: The largest value allowed, if any.
        optional: Whether None is allowed (the check is off).

    Raises:
        TypeError: If ``value`` is not a real number (or None, where allowed).
        ValueError: If it is not finite or out of range.
    """
    if optional and value is None:
        return
    if high is None:
        expected = f"a finite number {'>' if strict else '>='} {low:g}"
    else:
        expected = f"a number in {'(' if strict else '['}{low:g}, {high:g}]"
    expected += " or None" if optional else ""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be {expected}, {_got(value)}: pass a number, e.g. {name}={_example(low, high)}")
    in_range = (value > low if strict else value >= low) and (high is None or value <= high)
    if not math.isfinite(value) or not in_range:
        raise ValueError(f"`{name}` must be {expected}, got {value!r}: pass e.g. {name}={_example(low, high)}")


def _example(low: float, high: Optional[float]) -> str:
    return f"{high:g}" if high is not None else f"{max(low * 10, 1):g}"


def check_choice(name: str, value: Any, choices: Collection[str]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices`` (``TypeError`` if it is not a string)."""
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be one of {list(choices)}, {_got(value)}")
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}")


def check_names(name: str, values: Any, choices: Collection[str], allow_empty: bool = False,
                what: str = "name") -> tuple[str, ...]:
    """Check a list of names from ``choices`` (one bare name is taken as a list of it); return them as a tuple.

    ``what`` is a name's kind, for the message (``"stat"``: "unknown stat(s) ['median'] in `stats`").

    Raises:
        TypeError: If ``values`` is not a string or a list or tuple of strings.
        ValueError: If it is empty (unless ``allow_empty``), or a name is not one of ``choices``.
    """
    names = (values,) if isinstance(values, str) else values
    if not isinstance(names, (list, tuple)) or not all(isinstance(v, str) for v in names):
        raise TypeError(f"`{name}` must be a list of names from {list(choices)}, {_got(values)}")
    if not names and not allow_empty:
        raise ValueError(f"`{name}` is empty: name at least one of {list(choices)}")
    unknown = [v for v in names if v not in choices]
    if unknown:
        raise ValueError(f"unknown {what}(s) {unknown} in `{name}`; choose from {list(choices)}")
    return tuple(names)


def check_path(name: str, value: Any, optional: bool = False) -> None:
    """Check a directory argument: a non-empty ``str`` or ``os.PathLike`` (or None, where ``optional``)."""
    if optional and value is None:
        return
    expected = "a directory path" + (" or None" if optional else "")
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"`{name}` must be {expected}, {_got(value)}: pass a str or an os.PathLike")
    if not os.fspath(value):
        raise ValueError(f"`{name}` is empty: pass a directory" + (", or None to save nothing" if optional else ""))


def check_writable_dir(name: str, value: str | os.PathLike[str]) -> None:
    """Create the directory ``value`` if needed and write a file in it, so one that cannot be written fails now.

    Called in ``setup``: a read-only or missing mount fails before training, not at the first
    anomaly hours in.

    Raises:
        ValueError: If the directory cannot be created or written to; the message gives the reason.
    """
    path = os.fspath(value)
    try:
        os.makedirs(path, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".lightning_hooks-probe-", dir=path)
        os.close(handle)
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"`{name}`={path!r} cannot be written ({type(err).__name__}: {err.strerror or err}):"
                         f" pass a directory this process can write to, or {name}=None to save nothing") from err
