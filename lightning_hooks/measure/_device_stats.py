"""The statistics kernel for accelerators: a stat row from twelve kernels, no sort, no host sync.

On a GPU the cost of summarising a tensor is the number of kernels launched (a few
microseconds each), not the arithmetic. This kernel launches twelve per tensor, whatever its
size, and none of them sorts (``index_put_(accumulate=True)`` sorts its indices on CUDA) or
needs the host (``bincount`` sizes its output from the data):

1. ``bucketize`` sorts every value into a *slot*: the histogram bins, split so that exact
   zeros, -Inf, +Inf and NaN get slots of their own;
2-3. the slots are counted with ``scatter_add_`` (atomics) into a fresh accumulator;
4-7. the values and their negation, in float64, with non-finite entries at -inf, give the
   maximum and the negated minimum (``amax``), folded into the row (``maximum``);
8-11. the same float64 values, non-finite entries now 0, give their mean and spread in one
   ``var_mean`` (Welford: exact for a constant tensor, accurate when the mean dwarfs the
   spread), from which the sum and the sum of squares follow and are added to the row;
12. one matrix-vector product adds the slot counts to the row: element count, finite count,
   zeros, NaN, +Inf, -Inf, calls and the histogram bins (the zero slot counts in its bin too).

It runs on any device; on the CPU, where the native kernel or the tensor-op kernel serves,
the test suite runs it to check it gives the same figures.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class DeviceTable:
    """The constant tensors of :func:`accumulate_device_` for one device, dtype and set of bin edges.

    Args:
        edges: The histogram's bin edges (float64, increasing; the outer ones are taken as open).
        columns: The row's column index of each stat field (``count``, ``finite``, ``sum``,
            ``sum_sq``, ``zeros``, ``nan``, ``posinf``, ``neginf``, ``calls``, ``max``, ``neg_min``).
        n_fields: How many columns precede the histogram bins.
        device: Where the values live.
        dtype: Their dtype (float32 or float64): they are compared with edges of that dtype.
    """

    def __init__(
        self, edges: Tensor, columns: dict[str, int], n_fields: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        inner = edges[1:-1].to(dtype)
        below_zero = torch.nextafter(torch.zeros((), dtype=dtype), torch.full((), -1.0, dtype=dtype))
        cuts = torch.unique(torch.cat([inner, below_zero.view(1), torch.zeros(1, dtype=dtype)]))  # sorted
        bounds = torch.cat([torch.tensor([-math.inf], dtype=dtype), cuts,
                            torch.tensor([torch.finfo(dtype).max, math.inf], dtype=dtype)])
        # Slot i holds bounds[i-1] < v <= bounds[i]: slot 0 is -Inf, the last two +Inf and NaN.
        self.n_slots = bounds.numel() + 1
        right_ends = bounds[1:-1]  # of the finite slots 1 .. n_slots - 3
        finite_bins = torch.bucketize(right_ends, inner)
        n_bins = edges.numel() - 1
        self.columns, self.n_fields = columns, n_fields
        self._width = n_fields + n_bins
        self._slots: dict[str, list[int]] = {
            "finite": list(range(1, self.n_slots - 2)),
            "zeros": [1 + int(torch.nonzero(right_ends == 0)[0])],
            "neginf": [0], "posinf": [self.n_slots - 2], "nan": [self.n_slots - 1],
        }
        self._finite_bins = finite_bins.tolist()
        self.device = device
        self.bounds = bounds.to(device)
        # The accumulator: the slot counts, then a constant 1 for the calls, then the mean and
        # the mean square that var_mean writes.
        template = torch.zeros(self.n_slots + 3, dtype=torch.float64)
        template[self.n_slots] = 1.0
        self.template = template.to(device)
        self.ones = torch.ones((), dtype=torch.float64, device=device)
        self.signs = torch.tensor([[1.0], [-1.0]], dtype=torch.float64, device=device)
        self._matrices: dict[int, Tensor] = {}

    def matrix(self, calls: int) -> Tensor:
        """(row width, slots + 1) float64: how the slot counts and the constant 1 add into a row."""
        found = self._matrices.get(calls)
        if found is None:
            m = torch.zeros(self._width, self.n_slots + 1, dtype=torch.float64)
            m[self.columns["count"], : self.n_slots] = 1.0
            for field, slots in self._slots.items():
                m[self.columns[field], slots] = 1.0
            for offset, slot in enumerate(self._slots["finite"]):
                m[self.n_fields + self._finite_bins[offset], slot] = 1.0
            m[self.columns["calls"], self.n_slots] = float(calls)
            found = self._matrices[calls] = m.to(self.device)
        return found


@torch.no_grad()
def accumulate_device_(row: Tensor, values: Tensor, table: DeviceTable, calls: int) -> None:
    """Add the statistics of flat floating ``values`` into stat ``row``, in place, in twelve kernels.

    The same figures as the other kernels: exact counts, extremes and histogram; the sums in
    float64 from a Welford mean and spread.
    """
    n, s = values.numel(), table.n_slots
    acc = table.template.clone()
    acc[:s].scatter_add_(0, torch.bucketize(values, table.bounds), table.ones.expand(n))
    both = values.unsqueeze(0) * table.signs  # (2, n) float64: the values and their negation
    both.nan_to_num_(nan=-math.inf, posinf=-math.inf, neginf=-math.inf)
    extremes = row[table.columns["max"] : table.columns["neg_min"] + 1]
    torch.maximum(extremes, both.amax(1), out=extremes)
    finite = both[0].nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # the -inf entries were not finite
    mean, mean_square = acc[s + 1], acc[s + 2]
    torch.ops.aten.var_mean.correction_out(finite, None, correction=0, keepdim=False, out0=mean_square, out1=mean)
    mean_square.addcmul_(mean, mean)  # var + mean^2: the mean of the squares
    sums = row[table.columns["sum"] : table.columns["sum_sq"] + 1]
    sums.add_(acc[s + 1 :], alpha=n)
    row.addmv_(table.matrix(calls), acc[: s + 1])  # not the means: 0 * an infinite mean square is NaN
