"""Typed figure records: what the monitors emit and the sinks and listeners consume, one per block of rows.

A record says what its figures are (``kind``: the tag's first part, ``activations``,
``val_activations``, ``gradients`` or ``updates``; the ``stat``; each row's name) in fields, so a
listener such as LayerHealth reads them without parsing tags, and a tag renamed in a monitor can
no longer empty it in silence. The tags travel with the figures (each monitor makes them once per
fit) only to be written to the loggers as they were. One record per block of rows and step,
not a Python object per row: the hot path stays the arrays and lists it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

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
