"""A step's gradient figures: the L2 norm of each gradient, per parameter group and in total, batched on device.

:func:`gradient_figures` reads every gradient once (one ``torch._foreach_norm``; on the CPU the C pass
of :func:`~lightning_hooks.measure._update_passes.tensor_squares`, in float64, about 3x cheaper for
small layers); whether a gradient holds a NaN or an Inf follows from its norm, and is made only
when something reads it. The flags that judge these figures are in
:mod:`lightning_hooks.measure.anomalies`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_hooks.core._torch_internals import set_grad_mode
from lightning_hooks.measure._sharding import ShardGroups, local
from lightning_hooks.measure._update_passes import tensor_squares

_NARROW = (torch.float16, torch.bfloat16, torch.float32)


class GradientFigures:
    """What :func:`gradient_figures` measures; every field stays on the gradients' device.

    ``norms`` (widened to float64), ``bad`` and ``nonfinite`` are made when first read: a clean
    step that nothing logs reads none of them, and its flags need only :attr:`finite`.
    """

    __slots__ = ("measured", "_norms", "group_norms", "_sizes", "_bad", "_nonfinite", "_by_norm", "exact")

    def __init__(self, norms: Tensor, group_norms: Tensor, sizes: Sequence[int], bad: Optional[Tensor] = None,
                 by_norm: bool = False, exact: bool = False) -> None:
        self.measured = norms
        """(P,): the L2 norm of each gradient as measured (float32 for float32 and narrower gradients the
        tensor ops measured, float64 where the C pass did)."""
        self.exact = exact
        """Whether a norm is infinite or NaN exactly when its gradient holds an Inf or a NaN (the C pass's
        float64 sums: a finite float32 gradient's cannot overflow), so that :attr:`bad` needs no second pass."""
        self._norms = norms if norms.dtype is torch.float64 else None
        self.group_norms = group_norms
        """(G + 1,) float64: the L2 norm per parameter group (NaN for a group without
        gradients), then of all gradients together."""
        self._sizes, self._bad, self._nonfinite = tuple(sizes), bad, None
        self._by_norm = by_norm  # a column is finite exactly when its norm is (see `finite`)

    @property
    def norms(self) -> Tensor:
        """(P,) float64: the L2 norm of each gradient (:attr:`measured`, widened)."""
        if self._norms is None:
            self._norms = self.measured.double()
        return self._norms

    @property
    def by_norm(self) -> bool:
        """Whether a column (group or total) is finite exactly when its norm is (see :attr:`finite`)."""
        return self._by_norm

    @property
    def bad(self) -> Tensor:
        """(P,) bool: which gradients hold a NaN or an Inf (see ``exact`` in :func:`gradient_figures`)."""
        if self._bad is None:
            self._bad = ~torch.isfinite(self.measured)
        return self._bad

    @property
    def nonfinite(self) -> Tensor:
        """(G + 1,) int64: how many gradients hold a NaN or an Inf, per group, then in all."""
        if self._nonfinite is None:
            bad, sizes = self.bad, self._sizes
            total = bad.sum()
            if len(sizes) == 1:
                self._nonfinite = total.expand(2)
            else:
                starts = [sum(sizes[:g]) for g in range(len(sizes))]
                self._nonfinite = torch.stack([*(bad[s : s + n].sum() for s, n in zip(starts, sizes)), total])
        return self._nonfinite

    @property
    def finite(self) -> Tensor:
        """(G + 1,) bool: whether every gradient of the column (group, then all) is finite.

        Without ``exact``, for gradients of float32 or narrower in groups that all have some, a
        column is finite exactly when its norm is: a gradient's norm is NaN or infinite exactly
        when it counts as bad, and the float64 sum of the squares of finite float32 norms cannot
        overflow. One operation instead of counting.
        """
        return self.group_norms.isfinite() if self._by_norm else self.nonfinite == 0


def _foreach_norms(tensors: Sequence[Tensor], ord: float) -> tuple[list[Tensor], bool]:
    """Per-tensor norms, batched, accumulated in at least float32; and whether every tensor was float32 or narrower."""
    if not tensors:
        return [], True
    try:  # the usual case: one call, no look at each tensor's dtype
        return list(torch._foreach_norm(tensors, ord, dtype=torch.float32)), True
    except RuntimeError:  # a tensor wider than float32 (which a float32 accumulator would narrow)
        pass
    out: list[Optional[Tensor]] = [None] * len(tensors)
    narrow = [i for i, t in enumerate(tensors) if t.dtype in _NARROW]
    wide = [i for i, t in enumerate(tensors) if t.dtype not in _NARROW]
    for index, dtype in ((narrow, torch.float32), (wide, None)):
        if index:
            norms = torch._foreach_norm([tensors[i] for i in index], ord, dtype=dtype)
            for i, norm in zip(index, norms):
                out[i] = norm
    return [norm for norm in out if norm is not None], False


def _stacked(norms: list[Tensor], device: torch.device, dtype: Optional[torch.dtype] = torch.float64) -> Tensor:
    """``norms`` as one tensor on ``device``, of ``dtype`` (None: as they are); empty if there are none."""
    if not norms:
        return torch.zeros(0, dtype=dtype or torch.float32, device=device)
    try:  # the usual case, every norm on one device: no check per norm
        stacked = torch.stack(norms)
    except RuntimeError:  # norms on several devices
        # One `to` per tensor is one ATen call each, kernel or not: only for norms elsewhere.
        stacked = torch.stack([n if n.device == device else n.to(device) for n in norms])
    if dtype is None:
        return stacked if stacked.device == device else stacked.to(device)
    return stacked.to(device, dtype)


def gradient_figures(
    grads: Sequence[Tensor], group_sizes: Sequence[int], device: Optional[torch.device] = None,
    *, exact: bool = True, shards: Optional[ShardGroups] = None,
) -> GradientFigures:
    """Norms of gradients, per gradient, per parameter group and in total, batched on device.

    On the CPU, plain contiguous float32, float16 and bfloat16 gradients are read by one C pass
    (:func:`~lightning_hooks.measure._update_passes.tensor_squares`): sums of squares in float64,
    so the norms are ``torch.nn.utils.get_total_norm``'s up to the last bits, and a norm is
    non-finite exactly when its gradient holds a NaN or an Inf (:attr:`GradientFigures.exact`;
    ``exact`` then costs nothing more). Elsewhere (a GPU, other gradients) the total is the one
    ``get_total_norm`` gives, accumulated in float32 for float32 and narrower gradients: a
    gradient that holds a NaN or an Inf has a non-finite norm, but so has a finite gradient whose
    float32 norm overflows (beyond 3.4e38). With ``exact`` the two are told apart by each
    gradient's largest absolute value, one more pass over the gradients (one multi-tensor kernel
    on CUDA); without it, every gradient with a non-finite norm counts as holding a NaN or an
    Inf, which is exact whenever no norm is infinite (a NaN norm means a NaN or opposite Infs). A
    group without gradients, and the total when there is none at all, has a NaN norm.

    Sharded gradients (DTensors, see :class:`~lightning_hooks.measure._sharding.ShardGroups`) are
    measured on their local shards, and the shards' squared norms and non-finite counts are
    summed over the shard groups in one collective, so every figure is of the whole gradient
    and the same on every rank.

    Args:
        grads: Dense gradients, grouped by parameter group, in order.
        group_sizes: How many of ``grads`` each parameter group holds (0 for a group without
            gradients).
        device: Where the figures go; by default the device of ``grads[0]``. Needed when
            ``grads`` is empty.
        exact: Tell NaN and Inf gradients apart from finite ones whose norm overflows.
        shards: How ``grads`` are split across ranks (made from their parameters, DTensors or not);
            None when every rank holds them whole.

    Returns:
        The figures, on ``device``.

    Raises:
        ValueError: If ``group_sizes`` does not add up to the length of ``grads``, or ``grads``
            is empty and no ``device`` is given.

    Example::

        figures = gradient_figures([p.grad for p in model.parameters()], [4])
        total_norm = figures.group_norms[-1]

    """
    if sum(group_sizes) != len(grads) or min(group_sizes, default=0) < 0 or (not grads and device is None):
        raise ValueError(f"`group_sizes` {list(group_sizes)} must add up to the {len(grads)} gradients")
    # Not `torch.no_grad()` as a decorator: its Python frames (a context object made at each call) run at
    # every optimizer step, right after the backward pass has evicted them from the caches.
    enabled = torch.is_grad_enabled()
    set_grad_mode(False)
    try:
        return _figures(grads, group_sizes, grads[0].device if device is None else device, exact, shards)
    finally:
        set_grad_mode(enabled)


def _figures(grads: Sequence[Tensor], group_sizes: Sequence[int], device: torch.device, exact: bool,
             shards: Optional[ShardGroups]) -> GradientFigures:
    """:func:`gradient_figures`, its arguments checked, under ``no_grad``."""
    parts = grads if shards is not None and not shards.distributed else [local(g) for g in grads]
    sharded = shards is not None and shards.sharded
    squares = tensor_squares(parts) if device.type == "cpu" else None  # the C pass: float64, exact as to NaN and Inf
    native = squares is not None
    if native:
        narrow = True
        norms = squares if sharded else squares.sqrt()  # a shard's squares are summed first
    else:
        found, narrow = _foreach_norms(parts, 2.0)
        # Float32 norms stay float32 (read in float64, as the sums below take them, where something reads them).
        norms = _stacked(found, device, None if narrow and not sharded else torch.float64)
    apart = exact and not native  # a finite gradient's float32 norm may overflow: the bad ones measured apart
    bad = None  # made from the norms when read, unless it must be measured apart or summed (shards)
    if apart or sharded:
        bad = ~torch.isfinite(_stacked(_foreach_norms(parts, math.inf)[0], device) if apart else norms)
    if sharded:
        # Whole-gradient figures from the shards': squared norms and bad-shard counts add.
        summed = shards.sum_(torch.stack([norms if native else norms.square(), bad.double()], 1))
        norms, bad = summed[:, 0].sqrt(), summed[:, 1] > 0
    by_norm = bad is None and narrow and all(group_sizes)
    # Summed over the ranks, a shard another rank's tensor ops measured may have overflowed there: exact only alone.
    exact_norms = native and not sharded
    f64 = torch.float64
    if len(group_sizes) == 1 and grads:  # the usual case, one group: its figures are the totals, computed once
        total = torch.linalg.vector_norm(norms, dtype=f64)
        return GradientFigures(norms, total.expand(2), group_sizes, bad, by_norm=by_norm, exact=exact_norms)
    nan = torch.full((), math.nan, dtype=f64, device=device)
    group_norms, start = [], 0
    for size in group_sizes:
        group_norms.append(torch.linalg.vector_norm(norms[start : start + size], dtype=f64) if size else nan)
        start += size
    group_norms.append(torch.linalg.vector_norm(norms, dtype=f64) if grads else nan)
    return GradientFigures(norms, torch.stack(group_norms), group_sizes, bad, by_norm=by_norm, exact=exact_norms)
