"""Which layer left its range first, in a flight record: from outputs, else output gradients, else gradients.

Host-side and pure (numpy in, names out). Each series is judged against its own range measured
before it left it (:func:`onset`), so a ramp cannot widen its own range. The leader is then
chosen as LayerHealth's judge chooses a culprit (``lightning_hooks/output/_judge.py``,
docs/verdicts.md), on the record's rows:

- From the modules' outputs (ActivationMonitor's per-module std at its logged steps): the
  first module in forward order whose outputs are out of their range at the anomaly (its
  inputs, the modules before it, are in range; the ones after it are its victims, whichever
  crossed its range first: a ramp crosses its victims' in any order, and a layer still
  learning its scale may have drifted out long before). A NaN, an Inf or all zeros is born in
  one module and flows forward at once: the first in forward order where it appeared first.
  The first watched module's outputs moving is the batch (its input), not a layer: every
  layer at once.
- From the gradient reaching each module's output (ActivationMonitor's ``gradients=True``), when
  no module's outputs are out: each net of the last module's (the loss's side), as the judge does;
  the backward runs in reverse forward order, so of the modules whose output gradient left its
  range at the earliest departure, the *last* in forward order (the first the backward reached).
- From gradient norms alone: the earliest departure; layers that left at the same step are a
  tie, listed in the order their parameters were registered. A gradient flows back through
  every layer before the one that broke, and grows with that layer's gain, so gradient norms
  cannot tell a cause from its effects: a record judged from them says so.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from lightning_hooks.measure.spikes import _MAD_TO_STD
from lightning_hooks.output._findings import inner_first
from lightning_hooks.output._health_verdicts import NONFINITE_STATS
from lightning_hooks.output.figures import ScalarBlock

BAND_Z = 3.0  # a series is out of its usual range beyond 3 robust standard deviations (of its log) ...
MIN_BAND = float(np.log(1.5))  # ... and beyond a factor 1.5 either way, however steady it was
MIN_BASELINE = 4  # the usual range needs this many points before the record's second half


@dataclass(frozen=True)
class Departure:
    """Where a series left its usual range: the row, the log change at the end, the range ``(median, band)`` of logs."""

    row: int
    change: float
    usual: tuple[float, float]


@dataclass(frozen=True)
class Leader:
    """Who led: ``names`` (one, or a tie in forward order), the row they left at, and ``data`` (every layer at once)."""

    names: tuple[str, ...]
    row: int
    change: float
    data: bool = False
    every: bool = False  # gradient norms: every layer with a range tied (the batch, or a fault every gradient crosses)


def log_of(series: np.ndarray) -> np.ndarray:
    """The log of a positive series; NaN where it is not positive or not finite."""
    series = np.asarray(series, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(np.where((series > 0) & np.isfinite(series), series, np.nan))


def usual_range(logs: np.ndarray) -> Optional[tuple[float, float]]:
    """The median and the half-width of the usual range of a log series; None if it has too few finite points."""
    base = logs[np.isfinite(logs)]
    if len(base) < MIN_BASELINE:
        return None
    median = float(np.median(base))
    return median, max(BAND_Z * _MAD_TO_STD * float(np.median(np.abs(base - median))), MIN_BAND)


def onset(series: np.ndarray, finite_end: bool = True) -> Optional[Departure]:
    """Where the series left its usual range, measured before it left; None if it is in range at the end.

    The earliest row ``t`` from which every point to the end is out of the range of the points
    before ``t``. A NaN, a zero or a negative value counts as out of range; with ``finite_end``
    (gradient norms: a layer without a gradient at the anomaly says nothing) the last point must
    be a positive number.
    """
    raw = np.asarray(series, dtype=float)
    logs = log_of(raw)
    if finite_end and not np.isfinite(logs[-1]):
        return None
    for t in range(MIN_BASELINE, len(logs)):
        usual = usual_range(logs[:t])
        if usual is None:
            continue
        median, band = usual
        if not (np.abs(logs[t:] - median) <= band).any():  # NaN compares False: out of range
            end = logs[-1] if np.isfinite(logs[-1]) else (-np.inf if raw[-1] == 0 else np.inf)
            return Departure(t, float(end - median), usual)
    return None


def usual_level(series: np.ndarray, departure: Optional[Departure]) -> Optional[tuple[float, float]]:
    """The usual range as ``(level, factor)``: from before the departure (else the first half); None if unknown."""
    if departure is not None:
        median, band = departure.usual
    else:
        logs = log_of(series)
        usual = usual_range(logs[: len(logs) // 2])
        if usual is None:
            return None
        median, band = usual
    return float(np.exp(median)), float(np.exp(band))


def output_leader(modules: Sequence[str], levels: np.ndarray) -> Optional[Leader]:
    """The module whose outputs led, as the judge names a culprit (see the module docstring).

    Args:
        modules: The modules, in forward order.
        levels: ``(rows, modules)``: each module's output std at each logged step (NaN: a
            non-finite output).

    Returns:
        The leader (``data`` when it is the first module's outputs moving), or None when no
        module's outputs are out of range at the last row.
    """
    found = {i: onset(levels[:, i], finite_end=False) for i in range(len(modules))}
    out = {i: d for i, d in found.items() if d is not None}
    if not out:
        return None
    # A NaN, an Inf or all zeros is born somewhere and flows forward at once: the earliest, first in forward order.
    born = [i for i, d in out.items() if not (np.isfinite(levels[d.row, i]) and levels[d.row, i] > 0)]
    if born:
        first_row = min(out[i].row for i in born)
        leader = min(i for i in born if out[i].row == first_row)
    else:  # a level moved: the first module out in forward order (its inputs in range); a victim after it may
        leader = min(out)  # cross its range sooner (a ramp) or have drifted out while learning
    departure = out[leader]
    return Leader((modules[leader],), departure.row, departure.change, data=leader == 0 and not born)


def output_gradient_leader(modules: Sequence[str], grads: np.ndarray) -> Optional[Leader]:
    """The module whose output gradient led, as the judge names one (backward order, see the module docstring).

    Args:
        modules: The modules, in forward order (the last one is the loss's side).
        grads: ``(rows, modules)``: the std of the gradient reaching each module's output at each logged step.

    Returns:
        The leader, or None when no output gradient (net of the loss side's) is out of range at the last row.
    """
    if len(modules) < 2:
        return None
    side = log_of(grads[:, -1])  # the loss's own move, taken out of every other module's
    found = {}
    for i in range(len(modules) - 1):
        with np.errstate(invalid="ignore"):
            departure = onset(np.exp(log_of(grads[:, i]) - side))
        if departure is not None:
            found[i] = departure
    if not found:
        return None
    first_row = min(d.row for d in found.values())
    leader = max(i for i, d in found.items() if d.row == first_row)  # the first the backward pass reached
    return Leader((modules[leader],), first_row, found[leader].change)


def gradient_leader(layers: Sequence[str], found: dict[str, Optional[Departure]], known: int) -> Optional[Leader]:
    """The layers whose gradient norm left its range first: one, or a tie in their registration order.

    Args:
        layers: The layers, in the order their parameters were registered.
        found: Each layer's departure, or None.
        known: How many layers have a usual range: a tie of all of them is every layer at once
            (``every``), which gradient norms alone cannot tell from a fault whose gradient reaches them all.
    """
    out = [(d.row, i) for i, layer in enumerate(layers) if (d := found[layer]) is not None]
    if not out:
        return None
    first_row = min(row for row, _ in out)
    tied = [i for row, i in out if row == first_row]
    change = max((found[layers[i]].change for i in tied), key=abs)  # type: ignore[union-attr]
    return Leader(tuple(layers[i] for i in tied), first_row, change, data=False, every=1 < len(tied) >= known)


class OutputLevels:
    """The modules' output std (and output-gradient std) at the last ``size`` logged steps, on the host.

    Fed with what ActivationMonitor logs (already on the host: no device work, no transfer); a
    module whose outputs held a NaN or an Inf at a step has NaN there (out of any range), a
    module not logged at a step keeps its last value. The gradient reaching each module's output
    (``gradients=True``) is kept beside it, the same way.

    Args:
        size: How many logged steps it keeps.
    """

    def __init__(self, size: int) -> None:
        self.rows: deque[tuple[int, dict[str, float], dict[str, float]]] = deque(maxlen=size)
        self.order: dict[str, None] = {}  # the modules in forward order (``inner_first`` of their rows' order)
        self.grad_order: dict[str, None] = {}

    def add(self, step: int, levels: Mapping[str, float], gradients: Optional[Mapping[str, float]] = None) -> None:
        """Note the modules' output (and output-gradient) std at log step ``step`` (a second call adds to it)."""
        gradients = gradients or {}
        if not levels and not gradients:
            return
        if any(module not in self.order for module in levels):
            self.order = dict.fromkeys(inner_first(list(dict.fromkeys([*self.order, *levels]))))
        for module in gradients:
            self.grad_order.setdefault(module)
        if self.rows and self.rows[-1][0] == step:
            self.rows[-1][1].update(levels)
            self.rows[-1][2].update(gradients)
        else:
            self.rows.append((step, dict(levels), dict(gradients)))

    def since(self, step: int) -> OutputLevels:
        """The rows from log step ``step`` on (the span of a flight record), forward order kept."""
        kept = OutputLevels(self.rows.maxlen or 0)
        kept.order, kept.grad_order = dict(self.order), dict(self.grad_order)
        kept.rows.extend((at, dict(levels), dict(grads)) for at, levels, grads in self.rows if at >= step)
        return kept

    @property
    def steps(self) -> tuple[int, ...]:
        """The log step of each row, oldest first."""
        return tuple(step for step, _, _ in self.rows)

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules, in forward order."""
        return tuple(self.order)

    @property
    def gradient_modules(self) -> tuple[str, ...]:
        """The modules with an output gradient, in forward order (the outputs' order where known)."""
        index = {module: i for i, module in enumerate(self.order)}
        return tuple(sorted(self.grad_order, key=lambda m: index.get(m, len(index))))

    def array(self, gradients: bool = False) -> np.ndarray:
        """``(rows, modules)``: each module's output (or output-gradient) std (its last value where not logged)."""
        modules = self.gradient_modules if gradients else self.modules
        table = np.full((len(self.rows), len(modules)), np.nan)
        last: dict[str, float] = {}
        for r, (_, levels, grads) in enumerate(self.rows):
            last.update(grads if gradients else levels)
            table[r] = [last.get(module, np.nan) for module in modules]
        return table

    def departures(self) -> list[tuple[str, Departure]]:
        """The modules whose outputs are out of their range at the last row, with where they left (forward order)."""
        table, found = self.array(), []
        for i, module in enumerate(self.order):
            departure = onset(table[:, i], finite_end=False)
            if departure is not None:
                found.append((module, departure))
        return found


def output_levels(figures: Sequence[ScalarBlock], kind: str = "activations") -> dict[str, float]:
    """Each module's output std among a step's logged figures (ActivationMonitor's), NaN where it was non-finite.

    Args:
        figures: The step's logged blocks.
        kind: ``"activations"`` (the outputs) or ``"activation_grads"`` (the gradient reaching each output).
    """
    levels: dict[str, float] = {}
    bad: set[str] = set()
    for block in figures:
        if block.kind == kind and block.stat == "std":
            levels.update(zip(block.rows, block.values))
        elif block.kind == kind and block.stat in NONFINITE_STATS:
            bad.update(row for row, value in zip(block.rows, block.values) if value != 0)
    return {row: float("nan") if row in bad else value for row, value in levels.items()}
