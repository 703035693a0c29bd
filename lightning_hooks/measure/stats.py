"""On-device statistics and histogram kernels: pure tensor functions, no host sync.

:func:`accumulate_` adds the statistics of a tensor's values into a stat row (see
``_stat_rows`` for its columns), through the fused native CPU kernel, the accelerator kernel of
``_device_stats`` or tensor ops, into the bins of a :class:`Binning` (``_binning``: the bin edges
and their one owner, :func:`binning`). Non-finite values are masked out of the moments, the
extremes and the histogram and are counted on their own (NaN, +Inf, -Inf), so that a diverging run
still gets a histogram of its finite part instead of an error. The names of ``_binning``,
``_stat_rows`` and ``_tensor_values`` are importable from here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_hooks.measure._binning import (
    FLOAT32_MAX,
    MAX_BINS,
    NATIVE_KERNEL,
    Binning,
    Bins,
    binning,
    histogram_edges,
)
from lightning_hooks.measure._device_stats import accumulate_device_
from lightning_hooks.measure._native import accumulate_native_
from lightning_hooks.measure._stat_rows import (
    _COL,
    _MAX_SLICE,
    DEFAULT_STATS,
    DIVERGENCE_STATS,
    MAX_FIELDS,
    N_FIELDS,
    STAT_NAMES,
    SUM_FIELDS,
    bin_counts,
    new_rows,
    reduce_rows,
    reset_rows_,
    summarize,
)
from lightning_hooks.measure._tensor_values import as_float_values, iter_tensors

__all__ = [
    "DEFAULT_STATS", "DIVERGENCE_STATS", "FLOAT32_MAX", "MAX_BINS", "MAX_FIELDS", "NATIVE_KERNEL", "N_FIELDS",
    "STAT_NAMES",
    "SUM_FIELDS", "Binning", "Bins", "accumulate_", "as_float_values", "bin_counts", "binning", "histogram_edges",
    "iter_tensors", "new_rows", "reduce_rows", "reset_rows_", "summarize",
]


@torch.no_grad()
def accumulate_(row: Tensor, values: Tensor, binning: Binning, calls: int = 1) -> None:
    """Add the statistics of flat floating ``values`` into stat ``row``, in place, on device.

    Contiguous float32 values on the CPU go through the fused native kernel when it is built
    (one read of the values from memory; the custom op ``lightning_hooks::accumulate_f32``, in
    eager mode and under ``torch.compile``); values on an accelerator through the twelve kernels
    of :func:`lightning_hooks.measure._device_stats.accumulate_device_`; everything else (the CPU
    without the native kernel, float64 on the CPU, ``torch.compile`` on an accelerator) through
    tensor ops that inductor fuses. All give the same counts, extremes and histograms, and no host
    synchronisation; the sums are float64-exact in the native kernel and to rounding in the others.

    Args:
        row: One stat row (a view into a block from :func:`new_rows`), float64.
        values: Flat float32 or float64 values, as from :func:`as_float_values`.
        binning: The histogram bins for ``values``' device and dtype.
        calls: Added to the ``calls`` column: 0 for the second and later tensors of one call.
    """
    native = binning.native
    if (
        native is not None
        # Plain tensors only: a subclass (DTensor, a wrapper) may have no storage of its own,
        # and a negated view's memory holds the values un-negated (dynamo cannot trace is_neg;
        # the tensors a compiled graph computes are never negated views, and numpy() refuses one).
        and type(values) is Tensor
        and values.dtype == torch.float32
        and values.device.type == "cpu"
        and values.is_contiguous()
        and (torch.compiler.is_compiling() or not values.is_neg())
        and type(row) is Tensor
        and row.dtype == torch.float64
        and row.device.type == "cpu"
        and row.is_contiguous()
        and row.numel() == N_FIELDS + binning.n_bins
    ):
        table, right, fine = native
        accumulate_native_(values, row, table, right, fine, float(calls))
        return
    if values.device.type == "cpu" or torch.compiler.is_compiling() or row.device != values.device:
        _accumulate_tensors_(row, values, binning, calls)
    else:
        accumulate_device_(row, values, binning.device_table(), calls)


def _accumulate_tensors_(row: Tensor, values: Tensor, binning: Binning, calls: int) -> None:
    """:func:`accumulate_` in tensor ops, for any device and under ``torch.compile``.

    Non-finite values are first replaced by a finite one of the tensor (the pivot: its largest
    finite value), so that no later pass needs a mask; the pivot's share is taken out of the sums
    and the histogram again at the end. The pivot is a reduction, never a read at a
    data-dependent index: inductor's CPU code for ``argmax`` over a bool mask viewed as uint8
    gave indices out of bounds, and ``fit`` crashed under ``torch.compile``.
    """
    n = values.numel()
    finite = (values - values) == 0  # isfinite, cheaper on CPU: inf - inf and NaN give NaN
    n_finite = torch.count_nonzero(finite)
    n_bad = n - n_finite
    pivot = torch.where(n_finite > 0, torch.where(finite, values, -math.inf).amax(), 0.0).to(values.dtype)
    x = torch.where(finite, values, pivot)
    low, high = torch.aminmax(x)
    total, sum_sq = _finite_sums(x, finite, n_finite, n_bad, pivot, low, high)
    n_nan = torch.count_nonzero(values != values)
    n_posinf = torch.count_nonzero(values == math.inf)
    n_zero = n - torch.count_nonzero(values)
    # In SUM_FIELDS order, from "finite" to "neginf".
    sums = torch.cat([n_finite.double().view(1), total.view(1), sum_sq.view(1), n_zero.double().view(1),
                      torch.stack([n_nan, n_posinf, n_bad - n_nan - n_posinf]).double()]).to(row.device)
    row[_COL["finite"] : _COL["neginf"] + 1] += sums
    row[_COL["count"]] += n
    row[_COL["calls"]] += calls
    extremes = torch.stack([high, -low]).double().view(2)
    extremes = torch.where(n_finite > 0, extremes, -math.inf).to(row.device)
    row[_MAX_SLICE] = torch.maximum(row[_MAX_SLICE], extremes)
    row[N_FIELDS:] += _pivoted_counts(x, pivot, n_bad, binning).to(row.device)


def _finite_sums(x: Tensor, finite: Tensor, n_finite: Tensor, n_bad: Tensor, pivot: Tensor, low: Tensor,
                 high: Tensor) -> tuple[Tensor, Tensor]:
    """The sum and the sum of squares (float64) of the ``n_finite`` finite values of ``x`` (within ``low``, ``high``).

    ``x`` holds ``pivot`` where the values were not ``finite`` (``n_bad`` of them).
    """
    # Values scaled by a power of two (exact) so that squares up to float32 max cannot
    # overflow; deviations taken from an estimate of the mean (outliers and a mean that dwarfs
    # the spread cost no accuracy), with non-finite entries zeroed so their count neither.
    lo, hi = low.double(), high.double()
    span = torch.stack([hi / 2 - lo / 2, torch.maximum(hi.abs(), lo.abs()) * 2.0**-100]).amax()
    limit = 1022 if x.dtype == torch.float64 else 126  # largest exact power-of-two exponents
    scale = torch.ldexp(torch.ones((), dtype=torch.float64, device=x.device),
                        -torch.frexp(span).exponent.clamp(-limit, limit))
    scaled = x * scale.to(x.dtype)
    estimate = ((scaled.sum().double() - n_bad * pivot.double() * scale) / n_finite.clamp_min(1)).to(x.dtype)
    # Within the scaled extremes: a constant tensor scaled to ~2**100 whose rounded estimate sat an
    # ulp away from it gave deviations of ~2**77, whose squares overflow float32.
    estimate = estimate.clamp(low * scale.to(x.dtype), high * scale.to(x.dtype))
    dev = torch.where(finite, scaled.sub_(estimate), 0.0)
    centre = estimate.double() / scale
    sum_dev = dev.sum().double() / scale
    # Squared in place then summed: torch's pairwise sum, more accurate than a BLAS dot.
    sum_dev_sq = dev.square_().sum().double() / scale.square()
    return n_finite * centre + sum_dev, sum_dev_sq + 2 * centre * sum_dev + n_finite * centre.square()


def _pivoted_counts(x: Tensor, pivot: Tensor, n_bad: Tensor, binning: Binning) -> Tensor:
    """The histogram (float64, on ``x``'s device) of ``x``'s finite values: the ``n_bad`` pivots taken out."""
    index = binning.index(x)
    # bincount sizes its output from the data: a host sync on accelerators, a graph break
    # under compile.
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        counts = torch.zeros(binning.n_bins, dtype=torch.float64, device=x.device)
        counts.index_put_((index.long(),), torch.ones((), dtype=torch.float64, device=x.device).expand(x.numel()), True)
    else:
        counts = torch.bincount(index, minlength=binning.n_bins).double()
    counts.index_put_((binning.index(pivot.view(1)).long(),), -n_bad.double().view(1), accumulate=True)
    return counts
