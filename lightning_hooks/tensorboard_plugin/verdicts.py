"""Verdicts, not rankings: which cells of a run's figures are outside a healthy band, and since when.

Each threshold is a field of :class:`Thresholds` (its docstring says where each default comes
from); the tab's routes take any of them as a query parameter, e.g. ``?dead_fraction=0.8``.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Optional

from lightning_hooks.tensorboard_plugin.run_data import Figure

#: What each verdict means, as the banner says it.
PROBLEMS = {
    "dead": "dead units",
    "nonfinite": "non-finite values",
    "exploding": "exploding gradient",
    "vanishing": "vanishing gradient",
    "too_fast": "updates too large",
    "too_slow": "updates too small",
}
_NONFINITE_STATS = frozenset({"nonfinite_fraction", "nan_count", "posinf_count", "neginf_count"})


@dataclass(frozen=True)
class Thresholds:
    """Where the tab marks a cell; every field can be set by a query parameter of the same name.

    Attributes:
        dead_fraction: An activation whose ``zero_fraction`` is above this has dead units. 0.8:
            a ReLU layer on a healthy run outputs zero for about half its inputs; eight in ten
            zeros means at least three in five units have (nearly) stopped firing ("dying
            ReLU", CS231n's notes on activation functions). Only ReLU-like outputs have many
            exact zeros, so other layers are never marked.
        explode_history: A gradient norm above this multiple of the median of the layer's own
            earlier logged norms is exploding; 10: an order of magnitude above the layer's usual
            norm (GradientMonitor's ``relative_threshold`` is the same kind of rule, over a
            running median).
        min_history: How many earlier points a layer needs before its own history is used: 5,
            so that the climb from the small gradients of the first steps is not an explosion.
        neighbour_factor: A gradient norm this many times above (exploding) or below
            (vanishing) the median norm of its neighbouring layers at the same step; 100:
            layers of a healthy network differ by up to about 10x, rarely by 100x.
        neighbours: How many layers on each side (in forward order) are a layer's neighbours.
        vanish_norm: A gradient norm below this is vanishing whatever its neighbours: 1e-7 is
            about float32's machine epsilon, below which updates round away.
        update_target: The healthy ``log10`` update/parameter ratio: -3 (a ratio of 1e-3,
            Karpathy's heuristic in CS231n's "Babysitting the learning process").
        update_band: How many decades from ``update_target`` a ratio may be: 1.5 (between
            about 3e-5 and 3e-2).
    """

    dead_fraction: float = 0.8
    explode_history: float = 10.0
    min_history: int = 5
    neighbour_factor: float = 100.0
    neighbours: int = 2
    vanish_norm: float = 1e-7
    update_target: float = -3.0
    update_band: float = 1.5

    @classmethod
    def from_query(cls, args: Mapping[str, str]) -> Thresholds:
        """Thresholds with the defaults replaced by the query parameters that name a field.

        Raises:
            ValueError: A parameter that is not a positive number (``update_target`` may be any
                finite number), with the name and the value.
        """
        given: dict[str, Any] = {}
        for spec in fields(cls):
            if spec.name not in args:
                continue
            text = args[spec.name]
            try:
                value = int(text) if spec.type == "int" else float(text)
            except ValueError:
                raise ValueError(f"`{spec.name}` must be a {spec.type}, got {text!r}") from None
            if not math.isfinite(value) or (spec.name != "update_target" and value <= 0):
                raise ValueError(f"`{spec.name}` must be a finite positive number, got {text!r}")
            given[spec.name] = value
        return cls(**given)

    def as_dict(self) -> dict[str, float]:
        """The thresholds by name, as the routes report them."""
        return asdict(self)


Marks = list[tuple[int, int, str]]
"""A figure's marked cells: (row, column, verdict)."""


def judge(figure: Figure, limits: Thresholds) -> Marks:
    """The cells of ``figure`` outside the healthy band."""
    marks: Marks = []
    for row, values in enumerate(figure.values):
        history: list[float] = []  # the row's earlier finite values, sorted: its running median
        for col, value in enumerate(values):
            if value is None:
                continue
            verdict = _verdict(figure, row, col, value, limits, history)
            if verdict:
                marks.append((row, col, verdict))
            if math.isfinite(value):
                bisect.insort(history, value)
    return marks


def _verdict(
    figure: Figure, row: int, col: int, value: float, limits: Thresholds, history: list[float]
) -> Optional[str]:
    if not math.isfinite(value) or (figure.stat in _NONFINITE_STATS and value > 0):
        return "nonfinite"
    if figure.stat == "zero_fraction" and figure.kind.endswith("activations"):
        return "dead" if value > limits.dead_fraction else None
    if figure.kind == "updates" and figure.stat == "log10_ratio":
        offset = value - limits.update_target
        return "too_fast" if offset > limits.update_band else "too_slow" if offset < -limits.update_band else None
    if figure.kind == "gradients" and figure.stat == "norm":
        return _gradient_verdict(figure, row, col, value, limits, history)
    return None


def _gradient_verdict(
    figure: Figure, row: int, col: int, value: float, limits: Thresholds, history: list[float]
) -> Optional[str]:
    """Exploding against the layer's own history or its neighbours; vanishing against its neighbours."""
    mid = len(history) // 2  # history is sorted: its median without sorting again
    median = history[mid] if len(history) % 2 else (history[mid - 1] + history[mid]) / 2 if history else 0.0
    if len(history) >= limits.min_history and value > limits.explode_history * median:
        return "exploding"
    if value < limits.vanish_norm:
        return "vanishing"
    lo, hi = max(0, row - limits.neighbours), row + limits.neighbours + 1
    around = _finite([figure.values[r][col] for r in range(lo, min(hi, len(figure.rows))) if r != row])
    if around:
        middle = statistics.median(around)
        if value > limits.neighbour_factor * middle:
            return "exploding"
        if value * limits.neighbour_factor < middle:
            return "vanishing"
    return None


def _finite(values: list[Optional[float]]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def banner(judged: list[tuple[Figure, Marks]]) -> list[dict[str, Any]]:
    """The layers unhealthy at their last logged step: each problem, its figure, and since which step.

    "Since" is the first step of the unbroken stretch of marked cells that reaches the layer's
    last logged point. An empty list means the run looks healthy now.
    """
    found = []
    for figure, marks in judged:
        marked = {(row, col): verdict for row, col, verdict in marks}
        for row, name in enumerate(figure.rows):
            logged = [col for col, v in enumerate(figure.values[row]) if v is not None]
            if not logged or (row, logged[-1]) not in marked:
                continue
            verdict, since = marked[(row, logged[-1])], logged[-1]
            for col in reversed(logged[:-1]):
                if marked.get((row, col)) != verdict:
                    break
                since = col
            found.append({"layer": name, "figure": figure.key, "verdict": verdict, "problem": PROBLEMS[verdict],
                          "since": figure.steps[since], "value": figure.values[row][logged[-1]]})
    return found
