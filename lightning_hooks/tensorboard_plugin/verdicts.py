"""Verdicts, not rankings: which layer of a run went wrong, and since when.

The tab judges with LayerHealth's judge and defaults, from one place: the thresholds are
:class:`~lightning_hooks.output._health_verdicts.Bands` and each logged step, every judged figure
of it together, goes through the same :class:`~lightning_hooks.output._judge.Judge` LayerHealth
feeds, so the banner names the layer, with the problem, that LayerHealth's summary names; the
layers it hurt are not marked. The routes take any threshold as a query parameter named as in
:data:`QUERY`, e.g. ``?norm_factor=3``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_hooks.output._findings import EVERY_LAYER
from lightning_hooks.output._health_verdicts import JUDGED, STABILITY_BANDS, Bands, _figure_of, judged_figure
from lightning_hooks.output._judge import Judge
from lightning_hooks.tensorboard_plugin.run_data import Figure

#: The query parameters, each a field of :class:`Bands` (the band's two ends apart), with its type.
QUERY = {"max_zero_fraction": float, "level_factor": float, "norm_factor": float, "ratio_factor": float,
         "cusum": float, "window": int, "min_points": int, **dict.fromkeys(STABILITY_BANDS, float),
         "output_grad_factor": float}


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
    return Bands(**given)


def bands_as_dict(bands: Bands) -> dict[str, float]:
    """The bands by query parameter name, as the routes report them."""
    return {name: getattr(bands, name) for name in QUERY}


Marks = list[tuple[int, int, str]]
"""A figure's marked cells: (row, column, verdict)."""


@dataclass
class Replay:
    """A run replayed through LayerHealth's judge: each figure with its marked cells, and the judge that marked them.

    ``referee`` is asked, as LayerHealth asks it, which layer a row belongs to (:meth:`Judge.layer`).
    """

    figures: list[tuple[Figure, Marks]]
    referee: Judge


def judged_as(figure: Figure) -> Optional[str]:
    """Which of LayerHealth's judged figures ``figure`` is (``log10_ratio`` is the update ratio), or None."""
    stat = "ratio" if figure.kind == "updates" and figure.stat == "log10_ratio" else figure.stat
    return JUDGED.get((figure.kind, stat))


def judge(figures: list[Figure], bands: Bands, unjudged: frozenset[str] = frozenset(),
          order: Sequence[str] = (), scales: frozenset[str] = frozenset(),
          lookups: Optional[Mapping[str, str]] = None) -> Replay:
    """Each figure with its marked cells: the run replayed step by step through LayerHealth's judge.

    Args:
        figures: A run's figures (those not judged come back unmarked).
        bands: The thresholds.
        unjudged: 1-D parameter rows but norms' scales: their finite gradient norm and update ratio are not
            judged (as LayerHealth leaves them out: ``judged_figure``).
        order: The modules in the order their forward hooks first fired (ActivationMonitor's
            ``layers/forward_order``), as LayerHealth judges them; else the figures' row order.
        scales: Norms' scales: their update ratio is judged apart, their finite gradient norm not judged.
        lookups: The watched embeddings and their weights' rows (ActivationMonitor's ``layers/lookups``), as
            LayerHealth hands them to its judge: their outputs' drift as far as their weights moved is learning.

    Returns:
        The :class:`Replay`: every figure, in the order given, with its marked cells, and the judge.
    """
    kinds = [(figure, judged_as(figure)) for figure in figures]
    columns: dict[int, list[tuple[Figure, str, int]]] = {}
    for figure, kind in kinds:
        for col, step in enumerate(figure.steps):
            if kind is not None:
                columns.setdefault(step, []).append((figure, kind, col))
    marks: dict[int, Marks] = {id(figure): [] for figure in figures}
    referee = Judge(bands, order, lookups or {})
    for step in sorted(columns):
        values: dict[str, dict[str, float]] = {}
        where: dict[tuple[str, str], tuple[Figure, int]] = {}
        for figure, kind, col in columns[step]:
            log10 = figure.stat == "log10_ratio"
            for row, series in enumerate(figure.values):
                v, name = series[col], figure.rows[row]
                if v is None:
                    continue
                value = 10.0 ** v if log10 else v
                as_ = judged_figure(kind, name, value, unjudged, scales)  # as LayerHealth
                if as_ is None:
                    continue
                if as_ == "nonfinite":
                    value = max(values.get(as_, {}).get(name, 0.0), value)
                values.setdefault(as_, {})[name] = value
                where.setdefault((kind, name), (figure, row))
        for finding in referee.step(values, step).named:
            rows = [(finding.row, _figure_of(finding.problem))] if finding.problem != "data" else \
                [(name, "level") for name in values.get("level", {})]
            for name, kind in rows:
                if (kind, name) in where:
                    figure, row = where[(kind, name)]
                    marks[id(figure)].append((row, figure.steps.index(step), finding.problem))
    return Replay([(figure, sorted(marks[id(figure)])) for figure in figures], referee)


def banner(replay: Replay, bands: Bands) -> list[dict[str, Any]]:
    """The layers unhealthy at their last logged step: each problem, its figure, and since which step.

    "Since" is the first step of the unbroken stretch of marked cells that reaches the layer's
    last logged point (LayerHealth's episode); ``order`` is the problem's place in LayerHealth's
    order (its tie-break); ``module`` is the layer the judge says the row belongs to (a parameter's
    row is its module's: a module with its output and its weight's gradient out is one layer). A bad
    batch is one item, as LayerHealth names it: the row ``(every layer)``, its ``layers`` and their
    count as its value. An empty list means the run looks healthy now.
    """
    titles = bands.titles()
    order = {problem: i for i, problem in enumerate(titles)}
    found = []
    for figure, marks in replay.figures:
        kind = judged_as(figure)
        if kind is None:  # not judged: nothing marked
            continue
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
            found.append({"layer": name, "module": replay.referee.layer(kind, name), "figure": figure.key,
                          "verdict": verdict, "problem": titles[verdict], "since": figure.steps[since],
                          "value": figure.values[row][logged[-1]], "order": order[verdict]})
    return _the_batch_as_one(found)


def _the_batch_as_one(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The banner's ``data`` items (every layer out at once) folded into one, named as LayerHealth names it."""
    batch = [item for item in found if item["verdict"] == "data"]
    if not batch:
        return found
    layers = list(dict.fromkeys(item["layer"] for item in batch))
    one = {**batch[0], "layer": EVERY_LAYER, "since": min(item["since"] for item in batch), "value": len(layers),
           "layers": layers}
    return [one, *(item for item in found if item["verdict"] != "data")]
