"""Histogram bins: the fixed edges, and their one owner.

:func:`histogram_edges` computes the edges of a ``bins`` argument; :func:`binning` is their one
owner: computed once for each ``bins``, and their forms for a device once for each device and
dtype, shared by every stat block that bins with them (:class:`Binning`, with a fast bin index for
the default edges and the tables of the native and accelerator kernels).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Optional, Union

import torch
from torch import Tensor

from lightning_hooks.core._validation import check_int
from lightning_hooks.measure._device_stats import DeviceTable
from lightning_hooks.measure._native import NATIVE_KERNEL as _NATIVE_KERNEL
from lightning_hooks.measure._native import native_table
from lightning_hooks.measure._stat_rows import _COL, N_FIELDS

FLOAT32_MAX = float(torch.finfo(torch.float32).max)

Bins = Union[int, Sequence[float]]

#: Whether float32 CPU tensors go through the fused native kernel (same figures, ~10x faster).
#: Set ``LIGHTNING_HOOKS_NATIVE=0`` to use the tensor-op kernel everywhere.
NATIVE_KERNEL: bool = _NATIVE_KERNEL


#: The most histogram bins: more than a chart's width in pixels, and each one is written per row per logged step
#: (a million bins wrote 105 MB of events in 3 steps).
MAX_BINS = 4096


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
        TypeError: If ``bins`` is neither an int nor a sequence of numbers.
        ValueError: If ``bins`` is < 1 or over ``MAX_BINS`` (4096; as many bins as edges), or the
            edges are not strictly increasing, or ``0 < low < high < float32 max`` does not hold.
    """
    expected, fix = "a positive int or a sequence of edges", "pass e.g. bins=128 or bins=[-1.0, 0.0, 1.0]"
    if isinstance(bins, (bool, str, bytes)) or not isinstance(bins, (int, Iterable)):
        raise TypeError(f"`bins` must be {expected}, got {bins!r} ({type(bins).__name__}): {fix}")
    if not isinstance(bins, int):
        try:
            edges = torch.as_tensor(list(bins), dtype=torch.float64)
        except (TypeError, ValueError):
            raise TypeError(f"`bins` must be {expected}, got {bins!r}: its items must be numbers; {fix}") from None
        if edges.numel() > MAX_BINS + 1:
            raise ValueError(f"`bins` as edges must be at most {MAX_BINS + 1} numbers ({MAX_BINS} bins), got"
                             f" {edges.numel()}: {fix}")
        as_float32 = edges.float()  # float32 values are binned against float32 edges
        if edges.ndim != 1 or edges.numel() < 2 or not bool((as_float32[1:] > as_float32[:-1]).all()):
            raise ValueError(
                f"`bins` as edges must be >= 2 numbers, strictly increasing in float32, got {bins!r}"
            )
        return edges
    if bins < 1:
        raise ValueError(f"`bins` must be {expected}, got {bins!r}: {fix}")
    check_int("bins", bins, high=MAX_BINS)
    if not 0 < low < high < FLOAT32_MAX:
        raise ValueError(f"histogram range must satisfy 0 < low < high < 3.4e38, got {low=}, {high=}")
    n_positive = (bins + 1) // 2  # positive edges, the outermost being float32 max
    inner = torch.logspace(math.log10(low), math.log10(high), n_positive - 1, dtype=torch.float64)
    positive = torch.cat([inner, torch.tensor([FLOAT32_MAX], dtype=torch.float64)])
    middle = [torch.zeros(1, dtype=torch.float64)] if bins % 2 == 0 else []
    return torch.cat([-positive.flip(0), *middle, positive])


_Key = Union[int, tuple[float, ...]]


def _key(bins: Bins) -> Optional[_Key]:
    """``bins`` as a cache key: the int, or a list or tuple of numbers as a tuple; None for any other form."""
    if isinstance(bins, int) and not isinstance(bins, bool):
        return bins
    if isinstance(bins, (list, tuple)) and all(type(b) in (int, float) for b in bins):
        return tuple(bins)
    return None


@functools.lru_cache(maxsize=32)
def _shared_edges(key: _Key, low: float, high: float) -> Tensor:
    """The edges of one cache key, computed at its first use (a shared tensor: never written into)."""
    return histogram_edges(key if isinstance(key, int) else list(key), low, high)


def _edges_of(bins: Bins, low: float, high: float) -> Tensor:
    """The edges of ``bins``, computed once for each ``bins`` (a shared tensor: never written into)."""
    key = _key(bins)
    return histogram_edges(bins, low, high) if key is None else _shared_edges(key, low, high)


def binning(bins: Bins, device: Union[torch.device, str] = "cpu", dtype: torch.dtype = torch.float32) -> Binning:
    """The one :class:`Binning` of ``bins`` for values of ``dtype`` on ``device``, shared by every stat block.

    The bin edges are computed once for each ``bins``, and their forms for a device once for
    each device and dtype; every callback that bins with the same ``bins`` reads the same ones.

    Args:
        bins: As for :func:`histogram_edges`.
        device: Where the values to bin live.
        dtype: Their dtype (float32 or float64).

    Returns:
        The shared binning; read it, never write into its tensors.

    Raises:
        TypeError, ValueError: As :func:`histogram_edges`, for bad ``bins``.
    """
    key, where = _key(bins), torch.device(device)
    return Binning(bins, where, dtype) if key is None else _shared_binning(key, where, dtype, NATIVE_KERNEL)


@functools.lru_cache(maxsize=64)
def _shared_binning(key: _Key, device: torch.device, dtype: torch.dtype, native: bool) -> Binning:
    """One binning per key, device, dtype and choice of kernel (``native``: what :class:`Binning` reads)."""
    return Binning(key if isinstance(key, int) else list(key), device, dtype)


class Binning:
    """Histogram edges ready for one device and dtype, with a fast bin index for the default edges.

    ``torch.bucketize`` is a binary search per element and dominates the cost of a histogram.
    For the default symmetric log-spaced edges the bin follows from ``log2|x|`` in a few
    elementwise ops, then a comparison with the two edges of that bin corrects the rare
    rounding at an edge, so the result equals ``bucketize`` exactly. Explicit edges use
    ``bucketize``. Made through :func:`binning`, one per ``bins``, device and dtype.

    Args:
        bins: As for :func:`histogram_edges`.
        device: Where the values to bin live.
        dtype: Their dtype (float32 or float64): values are compared with edges of that dtype.
        low: Smallest positive default edge.
        high: Largest default edge below float32 max.
    """

    def __init__(
        self, bins: Bins, device: torch.device, dtype: torch.dtype, low: float = 1e-6, high: float = 1e6
    ) -> None:
        self._args = (device, dtype)
        self._device_table: DeviceTable | None = None
        self.edges = _edges_of(bins, low, high)
        """The bin edges, float64 on the CPU (shared: never written into)."""
        self.edge_list: tuple[float, ...] = tuple(self.edges.tolist())
        """The same edges as host numbers, for the sinks and the listeners."""
        edges = self.edges.to(device, dtype, copy=True)
        self.n_bins = edges.numel() - 1
        self._tiny = torch.finfo(dtype).tiny
        self.inner = edges[1:-1]
        self.right, self.left = edges[1:].contiguous(), edges[:-1].contiguous()
        # The outer bins take everything beyond their inner edge (float64 values can pass
        # float32 max).
        self.left[0], self.right[-1] = -math.inf, math.inf
        n_positive = (self.n_bins + 1) // 2
        self._log: tuple[int, float, float, float, float] | None = None
        if isinstance(bins, int) and n_positive >= 3:
            log_low, step = math.log2(low), (math.log2(high) - math.log2(low)) / (n_positive - 2)
            # Even counts have an edge at 0: x > 0 goes to n_positive + j, x <= 0 to n_positive - 1 - j.
            centre, half = (n_positive - 0.5, 0.5) if self.n_bins % 2 == 0 else (n_positive - 1.0, 0.0)
            self._log = (n_positive - 1, log_low, 1.0 / step, centre, half)
        self.native: tuple[Tensor, Tensor, bool] | None = None  # the C kernel's table, right edges, fine
        if NATIVE_KERNEL and device.type == "cpu" and dtype == torch.float32:
            table, fine = native_table(self.inner, self.right)
            self.native = (table, self.right, fine)
        if device.type != "cpu":  # now, not in a hook: copying the tables to the device syncs
            self.device_table()

    def device_table(self) -> DeviceTable:
        """The tables of the accelerator kernel, made at first use."""
        if self._device_table is None:
            device, dtype = self._args
            self._device_table = DeviceTable(self.edges, _COL, N_FIELDS, device, dtype)
        return self._device_table

    def index(self, x: Tensor) -> Tensor:
        """The bin of each finite value in ``x``: bin ``i`` holds ``edges[i] < x <= edges[i + 1]``."""
        if self._log is None:
            return torch.bucketize(x, self.inner)
        top, log_low, inv_step, centre, half = self._log
        # j: how many positive edges lie below |x|, taking every bin as right-closed. |x| is
        # raised to the smallest normal number first: it changes no bin (all below `low` give
        # j = 0), and log2(0) = -inf is about ten times slower on CPU than log2 of a number,
        # which made the ReLU outputs' histograms, half zeros, cost twice the others'.
        j = torch.log2(x.abs().clamp_(min=self._tiny)).sub_(log_low).mul_(inv_step).ceil_().clamp_(0, top).add_(half)
        index = torch.copysign(j, x).add_(centre).to(torch.int32)
        fix = (x > self.right.index_select(0, index)).to(torch.int32)
        fix -= (x <= self.left.index_select(0, index)).to(torch.int32)
        return index.add_(fix)
