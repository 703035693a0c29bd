"""Typed figure records: what the monitors emit and the sinks and listeners consume; the listeners' roles.

A record says what its figures are (``kind``: the tag's first part, ``activations``,
``val_activations``, ``gradients`` or ``updates``; the ``stat``; each row's name) in fields, so a
listener such as LayerHealth reads them without parsing tags, and a tag renamed in a monitor can
no longer empty it in silence. The tags travel with the figures (each monitor makes them once per
fit) only to be written to the loggers as they were. One record per block of rows and step,
not a Python object per row: the hot path stays the arrays and lists it was.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


class ScalarBlock(NamedTuple):
    """One statistic of a block of rows at one step: ``values[i]`` of row ``rows[i]``, logged under ``tags[i]``.

    Example::

        ScalarBlock("activations", "std", ["net.0", "net.2"], [0.8, 0.3],
                    ["activations/net.0/std", "activations/net.2/std"])
    """

    kind: str
    stat: str
    rows: Sequence[str]
    values: Sequence[float]
    tags: Sequence[str]

    @staticmethod
    def where(kind: str, stat: str, rows: Sequence[str], tags: Sequence[str], values: np.ndarray,
              mask: np.ndarray | None = None) -> ScalarBlock:
        """The block of the rows where ``mask`` holds (all of them without one), from per-row arrays.

        Args:
            kind: The tags' first part.
            stat: The statistic.
            rows: Every row's name.
            tags: Every row's tag for this statistic.
            values: Every row's value.
            mask: Which rows to keep.
        """
        if mask is None:
            return ScalarBlock(kind, stat, list(rows), values.tolist(), list(tags))
        index = np.flatnonzero(mask).tolist()
        return ScalarBlock(kind, stat, [rows[i] for i in index], values[index].tolist(), [tags[i] for i in index])


def as_metrics(blocks: Sequence[ScalarBlock], metrics: Mapping[str, float] | None = None) -> dict[str, float]:
    """``{tag: value}`` of ``metrics`` (scalars of no row: total norms, flags), then of every block, in order."""
    merged = dict(metrics or {})
    for block in blocks:
        merged.update(zip(block.tags, block.values))
    return merged


@dataclass(frozen=True)
class HistogramBlock:
    """A step's histograms of one kind as arrays, one row each: what a monitor builds without a Python object per row.

    Args:
        kind: The tags' first part (``activations``, ``val_activations``, ``gradients``).
        rows: One row name per histogram (module or parameter).
        tags: One tag per row (``<kind>/<row>``), written to the loggers.
        summary: Per statistic (at least ``count_finite``, ``min``, ``max``, ``sum``, ``sum_sq``), one value per row.
        counts: ``(rows, bins)`` counts per bin.
    """

    kind: str
    rows: Sequence[str]
    tags: Sequence[str]
    summary: Mapping[str, np.ndarray]
    counts: np.ndarray

    @staticmethod
    def of(kind: str, histograms: Sequence[tuple[str, Mapping[str, float], Sequence[float]]]) -> HistogramBlock:
        """The block of ``(row, summary, counts)`` histograms of ``kind`` (tests and small callers).

        Example::

            HistogramBlock.of("activations", [("fc", summary, [0, 3, 1])])  # tag "activations/fc"
        """
        keys = dict.fromkeys(k for _, s, _ in histograms for k in s)  # each summary's, in order
        summary = {k: np.array([s.get(k, np.nan) for _, s, _ in histograms], dtype=np.float64) for k in keys}
        counts = np.array([list(c) for _, _, c in histograms], dtype=np.float64).reshape(len(histograms), -1) \
            if histograms else np.zeros((0, 0))
        rows = [row for row, _, _ in histograms]
        return HistogramBlock(kind, rows, [f"{kind}/{row}" for row in rows], summary, counts)



class FigureListener:
    """Mixin for a callback that is handed every step's logged figures (no device work, no host sync).

    The sinks call these on rank zero with what they write: the figures are already on the host.
    A listener reads the typed records (:meth:`record_figures`, :meth:`record_histograms`):
    kind, statistic and row name are fields, never parsed out of a tag.
    """

    def record_figures(self, figures: Sequence[ScalarBlock], metrics: Mapping[str, float], step: int) -> None:
        """Receive the scalars logged at ``step``: the rows' as typed blocks, and every one by tag.

        Args:
            figures: One block per kind and statistic (``activations``/``std``, ``gradients``/``norm``...).
            metrics: Every scalar logged at ``step`` by its tag, the rows' and the others
                (``gradients/total_norm``, ``anomalies/<flag>``).
            step: The step they are logged at.

        By default hands ``metrics`` to :meth:`record_scalars`.
        """
        self.record_scalars(metrics, step)

    def record_scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """Receive every scalar logged at ``step``, by tag (for a listener that wants the tags only)."""

    def record_histograms(self, histograms: HistogramBlock, edges: Sequence[float], step: int) -> None:
        """Receive the histograms of one kind logged at ``step``, one row each, on shared ``edges``."""

    def record_forward_order(self, order: Sequence[str]) -> None:
        """Receive the watched modules in the order their forward hooks first fired (once a fit, before its figures)."""



class Diagnoses:
    """Base class of a callback that judges layers and gives a diagnosis (LayerHealth, TransformerStability).

    Its role: found by it in ``trainer.callbacks`` (``callbacks_of``), an AnomalyReport carries the
    diagnosis of the first one that has judged a step, and TransformerStability leaves the printing
    to another diagnoser when there is one (LayerHealth prints the same diagnosis in its summary).
    """

    @property
    def verdicts(self) -> Any:
        """The record of the judged figures (``output._health_verdicts.Verdicts``): ``last_step`` None until one."""
        raise NotImplementedError

    def diagnosis(self) -> str:
        """The diagnosis so far, in plain words."""
        raise NotImplementedError


Column = tuple[int, np.ndarray, float]
"""One logged step of a row's histogram: the step, the count per bin without the exact zeros, and those."""


def zero_bin(edges: Sequence[float]) -> int | None:
    """The bin exact zeros land in (the one whose right edge is 0, or that spans 0), or None."""
    if not edges or not edges[0] <= 0 <= edges[-1]:
        return None
    return max(0, int(np.searchsorted(np.asarray(edges), 0.0, side="left")) - 1)


class HistogramColumns:
    """A listener's bounded record of one kind's histograms: per row, a column per kept step, exact zeros apart.

    At most ``max_rows`` rows (the first ones received); per row at most ``max_columns``
    columns: past that every other one is dropped, and later steps are kept at the wider spacing.

    Args:
        kind: The histograms kept (``activations``); the others are passed over.
        max_rows: The most rows kept.
        max_columns: The most columns one row keeps.
    """

    def __init__(self, kind: str, max_rows: int, max_columns: int) -> None:
        self.kind, self.max_rows, self.max_columns = kind, max_rows, max_columns
        self.columns: dict[str, list[Column]] = {}
        self.edges: dict[str, list[float]] = {}
        """Each row's bin edges (monitors may bin differently)."""
        self._seen: dict[str, int] = {}  # histograms received per row, and the spacing of those kept
        self._stride: dict[str, int] = {}

    def add(self, histograms: HistogramBlock, edges: Sequence[float], step: int) -> None:
        """Keep the step's columns of ``histograms`` (of this kind), the exact zeros taken out of their bin."""
        if histograms.kind != self.kind:
            return
        shared, at = list(edges), zero_bin(edges)
        zero_fraction, count = histograms.summary.get("zero_fraction"), histograms.summary.get("count")
        exact_zeros = zero_fraction * count if at is not None and zero_fraction is not None and count is not None \
            else np.zeros(len(histograms.rows))
        for i, name in enumerate(histograms.rows):
            column = np.array(histograms.counts[i], dtype=np.float64)  # a copy: its zero bin changes
            zeros = float(exact_zeros[i])
            if at is not None and math.isfinite(zeros):
                column[at] = max(column[at] - zeros, 0.0)
            if self._add(name, step, column, zeros if math.isfinite(zeros) else 0.0):
                self.edges[name] = shared

    def _add(self, name: str, step: int, counts: np.ndarray, zeros: float) -> bool:
        """Keep one step's counts for ``name`` if there is room; return whether they were kept."""
        if name not in self.columns and len(self.columns) >= self.max_rows:
            return False
        seen, stride = self._seen.get(name, 0), self._stride.get(name, 1)
        self._seen[name] = seen + 1
        if seen % stride:
            return False
        columns = self.columns.setdefault(name, [])
        columns.append((step, counts, zeros))
        if len(columns) > self.max_columns:
            self.columns[name], self._stride[name] = columns[::2], stride * 2
        return True
