"""The stat row: what its columns hold, and what is done with rows once the kernels filled them.

A *stat row* is a float64 vector that summarises any number of tensors and can be added up
across tensors, steps and ranks:

- columns ``SUM_FIELDS`` add (element counts, sums, histogram counts; ``calls`` adds within a
  rank and takes the maximum across ranks),
- columns ``MAX_FIELDS`` take the maximum (the maximum and the negated minimum),
- the last ``bins`` columns are histogram counts over fixed bin edges.

Blocks of rows are made and emptied on device (:func:`new_rows`, :func:`reset_rows_`), combined
across ranks (:func:`reduce_rows`) and, once on the host, read as named statistics
(:func:`summarize`, :func:`summarize_rows` for a whole block, :func:`bin_counts`). The kernels that
fill them are in ``stats``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

SUM_FIELDS = ("count", "finite", "sum", "sum_sq", "zeros", "nan", "posinf", "neginf", "calls")
MAX_FIELDS = ("max", "neg_min")
N_FIELDS = len(SUM_FIELDS) + len(MAX_FIELDS)
_COL = {name: i for i, name in enumerate(SUM_FIELDS + MAX_FIELDS)}
_MAX_SLICE = slice(len(SUM_FIELDS), N_FIELDS)

#: Statistics a stat row can report, by name.
STAT_NAMES = (
    "mean", "std", "min", "max", "abs_max", "zero_fraction", "nonfinite_fraction",
    "nan_count", "posinf_count", "neginf_count", "count", "calls",
)

#: The statistics ActivationMonitor logs by default: those that move on a healthy run (with
#: ``stats=None``, ``zero_fraction`` and ``nonfinite_fraction`` only where they are not 0 by
#: construction: see ActivationMonitor).
DEFAULT_STATS = ("mean", "std", "abs_max", "zero_fraction", "nonfinite_fraction")

#: Counters of non-finite values: zero on a healthy run, so logged only while they are not.
DIVERGENCE_STATS = ("nan_count", "posinf_count", "neginf_count")


def new_rows(n_rows: int, n_bins: int, device: torch.device | str | None = None) -> Tensor:
    """An empty block of stat rows: zeros, with the max columns at -inf."""
    return reset_rows_(torch.empty(n_rows, N_FIELDS + n_bins, dtype=torch.float64, device=device))


def reset_rows_(rows: Tensor) -> Tensor:
    """Empty a block of stat rows in place (zeros, the max columns at -inf) and return it."""
    rows.zero_()
    rows[:, _MAX_SLICE] = -math.inf
    return rows


def reduce_rows(gathered: Tensor) -> Tensor:
    """Combine the stat rows of several ranks, stacked along dim 0, into one block.

    Sums add and extremes take the max: the figures of the global batch. ``calls`` takes the
    max as well: it counts a module's calls on one rank (the most of any rank), as each rank
    runs the module once on its part of the batch, so that it reads as one process's would.
    """
    out = gathered.sum(0)
    out[..., _MAX_SLICE] = gathered[..., _MAX_SLICE].amax(0)
    out[..., _COL["calls"]] = gathered[..., _COL["calls"]].amax(0)
    return out


def bin_counts(row: Sequence[float]) -> Sequence[float]:
    """The histogram counts of one stat row (the columns after the statistics)."""
    return row[N_FIELDS:]


def summarize(row: Sequence[float]) -> dict[str, float]:
    """Every statistic in ``STAT_NAMES`` from one host-side stat row (a list of floats).

    ``std`` uses Bessel's correction, like ``torch.std``. Figures over no finite value are NaN.
    Also returns the raw ``count_finite``, ``sum`` and ``sum_sq`` that histograms need. One row
    of :func:`summarize_rows`, so both give the same figures.
    """
    block = np.asarray(row[:N_FIELDS], dtype=np.float64).reshape(1, N_FIELDS)
    return {name: float(values[0]) for name, values in summarize_rows(block).items()}


def summarize_rows(rows: np.ndarray) -> dict[str, np.ndarray]:
    """:func:`summarize` of every row of a host-side block at once: one float64 array per statistic.

    The same operations in the same order as :func:`summarize`, element by element, so every
    figure is bit for bit the one it gives for that row; vectorised, so that a block of a
    thousand rows costs a few array operations instead of a thousand dicts.

    Args:
        rows: ``(n, N_FIELDS + bins)`` float64 stat rows (the bins are not read).
    """
    c = {name: rows[:, i] for name, i in _COL.items()}
    n, count = c["finite"], c["count"]
    some, several, counted = n > 0, n > 1, count > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.where(some, c["sum"] / np.where(some, n, 1.0), math.nan)
        var = np.where(several, (c["sum_sq"] - n * mean * mean) / np.where(several, n - 1, 1.0), math.nan)
        std = np.where(np.isnan(var), math.nan, np.sqrt(np.maximum(var, 0.0)))
        high, low = np.where(some, c["max"], math.nan), np.where(some, -c["neg_min"], math.nan)
        per_value = np.where(counted, count, 1.0)
        return {
            "mean": mean,
            "std": std,
            "min": low,
            "max": high,
            "abs_max": np.where(some, np.maximum(np.abs(high), np.abs(low)), math.nan),
            "zero_fraction": np.where(counted, c["zeros"] / per_value, math.nan),
            "nonfinite_fraction": np.where(counted, (count - n) / per_value, math.nan),
            "nan_count": c["nan"],
            "posinf_count": c["posinf"],
            "neginf_count": c["neginf"],
            "count": count,
            "calls": c["calls"],
            "count_finite": n,
            "sum": c["sum"],
            "sum_sq": c["sum_sq"],
        }
