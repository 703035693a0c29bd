"""Verdicts, not rankings: which cells of a run's figures are outside a healthy band, and since when.

The tab judges with LayerHealth's rules and defaults, from one place: the bands are
:class:`~lightning_hooks.output._health_verdicts.Bands` (its module docstring says where each default
comes from) and each logged step (a column) is judged by the same functions LayerHealth calls,
so the banner names the layers, with the problems, that LayerHealth's summary names. The routes
take any band as a query parameter named as in :data:`QUERY`, e.g. ``?max_zero_fraction=0.9``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, Optional

from lightning_hooks.output._health_verdicts import JUDGED, STABILITY_BANDS, Bands
from lightning_hooks.output._health_verdicts import judge as judge_column
from lightning_hooks.tensorboard_plugin.run_data import Figure

#: The query parameters, each a field of :class:`Bands` (the band's two ends apart), with its type.
QUERY = {"max_zero_fraction": float, "spike_factor": float, "spread_factor": float,
         "update_ratio_low": float, "update_ratio_high": float, "window": int,
         **dict.fromkeys(STABILITY_BANDS, float)}


def bands_from_query(args: Mapping[str, str]) -> Bands:
    """:class:`Bands` with the defaults replaced by the query parameters of :data:`QUERY` that are given.

    Raises:
        ValueError: A parameter that is not a number (``window``: an int), or bands that
            :class:`Bands` refuses (its message says which and why).
    """
    given: dict[str, Any] = {}
    for name, kind in QUERY.items():
        if name in args:
            try:
                given[name] = kind(args[name])
            except ValueError:
                raise ValueError(f"`{name}` must be a{'n int' if kind is int else ' number'}, "
                                 f"got {args[name][:40]!r}") from None
    low, high = Bands.update_ratio_band
    band = (given.pop("update_ratio_low", low), given.pop("update_ratio_high", high))
    return Bands(update_ratio_band=band, **given)


def bands_as_dict(bands: Bands) -> dict[str, float]:
    """The bands by query parameter name, as the routes report them."""
    low, high = bands.update_ratio_band
    return {"max_zero_fraction": bands.max_zero_fraction, "spike_factor": bands.spike_factor,
            "spread_factor": bands.spread_factor, "update_ratio_low": low, "update_ratio_high": high,
            "window": bands.window, **{name: getattr(bands, name) for name in STABILITY_BANDS}}


Marks = list[tuple[int, int, str]]
"""A figure's marked cells: (row, column, verdict)."""


def judged_as(figure: Figure) -> Optional[str]:
    """Which of LayerHealth's judged figures ``figure`` is (``log10_ratio`` is the update ratio), or None."""
    stat = "ratio" if figure.kind == "updates" and figure.stat == "log10_ratio" else figure.stat
    return JUDGED.get((figure.kind, stat))


def judge(figure: Figure, bands: Bands, unjudged: frozenset[str] = frozenset()) -> Marks:
    """The cells of ``figure`` outside the healthy band, judged step by step as LayerHealth judges them.

    Args:
        figure: One figure of a run.
        bands: The healthy bands.
        unjudged: Update rows whose ratio is not judged (1-D parameters, as LayerHealth skips them).
    """
    kind = judged_as(figure)
    if kind is None:
        return []
    log10 = figure.stat == "log10_ratio"
    norms: dict[str, deque[float]] = {}  # each row's recent norms, as LayerHealth keeps them
    index = {name: row for row, name in enumerate(figure.rows)}
    marks: Marks = []
    for col in range(len(figure.steps)):
        column = {name: (10.0 ** v if log10 else v) for name, values in zip(figure.rows, figure.values)
                  if (v := values[col]) is not None and not (kind == "ratio" and name in unjudged)}
        marks.extend((index[name], col, problem)
                     for name, problem in judge_column(kind, column, bands, norms).items())
    return sorted(marks)


def banner(judged: list[tuple[Figure, Marks]], bands: Bands) -> list[dict[str, Any]]:
    """The layers unhealthy at their last logged step: each problem, its figure, and since which step.

    "Since" is the first step of the unbroken stretch of marked cells that reaches the layer's
    last logged point (LayerHealth's episode). An empty list means the run looks healthy now.
    """
    titles = bands.titles()
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
            found.append({"layer": name, "figure": figure.key, "verdict": verdict, "problem": titles[verdict],
                          "since": figure.steps[since], "value": figure.values[row][logged[-1]]})
    return found
