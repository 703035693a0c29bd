"""On-device statistics and histogram kernels: pure tensor functions, no host sync.

A *stat row* is a float64 vector that summarises any number of tensors and can be added up
across tensors, steps and ranks:

- columns ``SUM_FIELDS`` add (element counts, sums, histogram counts),
- columns ``MAX_FIELDS`` take the maximum (the maximum and the negated minimum),
- the last ``bins`` columns are histogram counts over fixed bin edges.

Non-finite values are masked out of the moments, the extremes and the histogram and are
counted on their own (NaN, +Inf, -Inf), so that a diverging run still gets a histogram of its
finite part instead of an error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import fields, is_dataclass
from typing import Any, Union

import torch
from torch import Tensor

SUM_FIELDS = ("count", "finite", "sum", "sum_sq", "zeros", "nan", "posinf", "neginf", "calls")
MAX_FIELDS = ("max", "neg_min")
N_FIELDS = len(SUM_FIELDS) + len(MAX_FIELDS)
_COL = {name: i for i, name in enumerate(SUM_FIELDS + MAX_FIELDS)}
_MAX_SLICE = slice(len(SUM_FIELDS), N_FIELDS)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)

#: Statistics a stat row can report, by name.
STAT_NAMES = (
    "mean", "std", "min", "max", "abs_max", "zero_fraction", "nonfinite_fraction",
    "nan_count", "posinf_count", "neginf_count", "count", "calls",
)

Bins = Union[int, Sequence[float]]


def histogram_edges(bins: Bins = 128, low: float = 1e-6, high: float = 1e6) -> Tensor:
    """Fixed histogram bin edges, symmetric about zero and log-spaced, covering all of float32.

    With an int, the edges are ``±logspace(low, high)`` plus ``±float32 max`` as the outermost
    edges (so 1e30 still lands in a bin) and, for an even count, an edge at 0. Fixed edges let
    counts add across modules, steps and ranks.

    Args:
        bins: Number of bins, or an increasing sequence of at least two edges.
        low: Smallest positive edge (values within ``±low`` share the central bin(s)).
        high: Largest edge below float32 max.

    Returns:
        float64 tensor of ``n_bins + 1`` increasing edges.

    Raises:
        ValueError: If ``bins`` is < 1, or the edges are not strictly increasing, or
            ``0 < low < high < float32 max`` does not hold.
    """
    if not isinstance(bins, int):
        try:
            edges = torch.as_tensor(list(bins), dtype=torch.float64)
        except (TypeError, ValueError):
            raise ValueError(f"`bins` must be a positive int or a sequence of edges, got {bins!r}") from None
        as_float32 = edges.float()  # float32 values are binned against float32 edges
        if edges.ndim != 1 or edges.numel() < 2 or not bool((as_float32[1:] > as_float32[:-1]).all()):
            raise ValueError(
                f"`bins` as edges must be >= 2 numbers, strictly increasing in float32, got {bins!r}"
            )
        return edges
    if isinstance(bins, bool) or bins < 1:
        raise ValueError(f"`bins` must be a positive int or a sequence of edges, got {bins!r}")
    if not 0 < low < high < FLOAT32_MAX:
        raise ValueError(f"histogram range must satisfy 0 < low < high < 3.4e38, got {low=}, {high=}")
    n_positive = (bins + 1) // 2  # positive edges, the outermost being float32 max
    inner = torch.logspace(math.log10(low), math.log10(high), n_positive - 1, dtype=torch.float64)
    positive = torch.cat([inner, torch.tensor([FLOAT32_MAX], dtype=torch.float64)])
    middle = [torch.zeros(1, dtype=torch.float64)] if bins % 2 == 0 else []
    return torch.cat([-positive.flip(0), *middle, positive])


def new_rows(n_rows: int, n_bins: int, device: torch.device | str | None = None) -> Tensor:
    """An empty block of stat rows: zeros, with the max columns at -inf."""
    return reset_rows_(torch.empty(n_rows, N_FIELDS + n_bins, dtype=torch.float64, device=device))


def reset_rows_(rows: Tensor) -> Tensor:
    """Empty a block of stat rows in place (zeros, the max columns at -inf) and return it."""
    rows.zero_()
    rows[:, _MAX_SLICE] = -math.inf
    return rows


def iter_tensors(value: Any, _depth: int = 0) -> Iterator[Tensor]:
    """Every tensor inside a module's output: tuples, lists, dicts, dataclasses; others skipped."""
    if isinstance(value, Tensor):
        yield value
    elif _depth > 8:
        return
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from iter_tensors(item, _depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item, _depth + 1)
    elif is_dataclass(value) and not isinstance(value, type):
        for field in fields(value):
            yield from iter_tensors(getattr(value, field.name, None), _depth + 1)


def as_float_values(tensor: Tensor) -> Tensor | None:
    """The flat floating values that stats are taken over, or None for a tensor we skip.

    float64 tensors keep float64 (a finite 1e300 stays finite); other floating, integer and
    bool tensors give float32; complex tensors their magnitude. Sparse, quantized, meta and
    empty tensors are skipped.
    """
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta or tensor.numel() == 0:
        return None
    values = tensor.detach()
    if values.is_complex():
        values = values.abs()
    values = values.reshape(-1)
    return values if values.dtype == torch.float64 else values.float()


@torch.no_grad()
def accumulate_(row: Tensor, values: Tensor, inner_edges: Tensor, zero_bin: int, calls: int = 1) -> None:
    """Add the statistics of flat floating ``values`` into stat ``row``, in place, on device.

    Args:
        row: One stat row (a view into a block from :func:`new_rows`), float64.
        values: Flat float32 or float64 values, as from :func:`as_float_values`.
        inner_edges: The bin edges without the outermost two, on ``values``' device and dtype.
        zero_bin: Index of the bin that holds 0 (masked values land there and are taken out).
        calls: Added to the ``calls`` column: 0 for the second and later tensors of one call.
    """
    finite = torch.isfinite(values)
    n_finite = finite.sum()
    n_nan = torch.isnan(values).sum()
    n_posinf = torch.isposinf(values).sum()
    clean = torch.where(finite, values, 0.0)
    high = torch.where(finite, values, -math.inf).max()
    low = torch.where(finite, values, math.inf).min()
    total = clean.sum(dtype=torch.float64)
    # The sum of squares is taken about this tensor's own mean ``a`` (so std stays exact when
    # the mean dwarfs it), on halved values (exact, and their differences cannot overflow),
    # squared after scaling by the largest deviation, then shifted back in float64:
    # sum x^2 = 4 sum ((x-a)/2)^2 + a (2 sum x - n a).
    shift = (total / n_finite.clamp_min(1)).to(values.dtype)
    half_dev = torch.where(finite, clean * 0.5 - shift * 0.5, 0.0)
    spread = half_dev.abs().max().clamp_min(1e-30)
    sum_sq = (half_dev / spread).square().sum(dtype=torch.float64) * (2 * spread.double()).square()
    sum_sq = sum_sq + shift.double() * (2 * total - n_finite * shift.double())
    n_zero = (values == 0).sum()
    n_neginf = values.numel() - n_finite - n_nan - n_posinf
    # In SUM_FIELDS order, from "finite" to "neginf".
    sums = torch.stack([n_finite.double(), total, sum_sq, n_zero.double(), n_nan.double(),
                        n_posinf.double(), n_neginf.double()]).to(row.device)
    row[_COL["finite"] : _COL["neginf"] + 1] += sums
    row[_COL["count"]] += values.numel()
    row[_COL["calls"]] += calls
    row[_MAX_SLICE] = torch.maximum(row[_MAX_SLICE], torch.stack([high, -low]).double().to(row.device))
    hist = row[N_FIELDS:]
    index = torch.bucketize(clean, inner_edges)
    ones = torch.ones((), dtype=torch.float64, device=row.device).expand(index.numel())
    hist.index_put_((index.to(row.device),), ones, accumulate=True)
    hist[zero_bin] -= values.numel() - n_finite.double().to(row.device)


def reduce_rows(gathered: Tensor) -> Tensor:
    """Combine stat rows stacked along dim 0 (e.g. one block per rank) into one block."""
    out = gathered.sum(0)
    out[..., _MAX_SLICE] = gathered[..., _MAX_SLICE].amax(0)
    return out


def summarize(row: Sequence[float]) -> dict[str, float]:
    """Every statistic in ``STAT_NAMES`` from one host-side stat row (a list of floats).

    ``std`` uses Bessel's correction, like ``torch.std``. Figures over no finite value are NaN.
    Also returns the raw ``count_finite``, ``sum`` and ``sum_sq`` that histograms need.
    """
    c = {name: row[i] for name, i in _COL.items()}
    n, count = c["finite"], c["count"]
    mean = c["sum"] / n if n > 0 else math.nan
    var = (c["sum_sq"] - n * mean * mean) / (n - 1) if n > 1 else math.nan
    high, low = (c["max"], -c["neg_min"]) if n > 0 else (math.nan, math.nan)
    return {
        "mean": mean,
        "std": math.sqrt(max(var, 0.0)) if not math.isnan(var) else math.nan,
        "min": low,
        "max": high,
        "abs_max": max(abs(high), abs(low)) if n > 0 else math.nan,
        "zero_fraction": c["zeros"] / count if count > 0 else math.nan,
        "nonfinite_fraction": (count - n) / count if count > 0 else math.nan,
        "nan_count": c["nan"],
        "posinf_count": c["posinf"],
        "neginf_count": c["neginf"],
        "count": count,
        "calls": c["calls"],
        "count_finite": n,
        "sum": c["sum"],
        "sum_sq": c["sum_sq"],
    }
