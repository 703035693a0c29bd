"""Per-step stat buffers on device, reduced across ranks and moved to the host once per step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_hooks.stats import (
    Bins,
    accumulate_,
    as_float_values,
    histogram_edges,
    iter_tensors,
    new_rows,
    reduce_rows,
)


class StatBlock:
    """One stat row per name, filled on device by hooks and drained once per logged step.

    Rows add across tensors, calls and micro-batches until :meth:`drain`, which reduces them
    across ranks with a single ``all_gather`` (sums add, extremes take the max), moves them to
    the host in one transfer, and resets the block.

    Args:
        names: One name per row (e.g. the selected modules).
        bins: Histogram bins, see :func:`lightning_hooks.stats.histogram_edges`.
        device: Where the rows live (the LightningModule's device).
    """

    def __init__(self, names: list[str], bins: Bins, device: torch.device | str) -> None:
        self.names = names
        self.edges = histogram_edges(bins)
        inner = self.edges[1:-1]
        self.zero_bin = int(torch.bucketize(torch.zeros((), dtype=torch.float64), inner))
        self.rows = new_rows(len(names), self.edges.numel() - 1, device)
        # Filled for the rows' device up front: under torch.compile a first miss costs a recompile.
        device = self.rows.device
        self._inner: dict[torch.device, Tensor] = {device: inner.to(device, torch.float32)}
        self.pending = False

    def add(self, index: int, tensor: Tensor, calls: int = 1) -> bool:
        """Add one tensor's statistics, and ``calls`` calls, to row ``index``.

        Returns whether the tensor was added: tensors we cannot summarise are skipped.
        """
        values = as_float_values(tensor)
        if values is None:
            return False
        inner = self._inner.get(values.device)
        if inner is None:
            inner = self._inner[values.device] = self.edges[1:-1].to(values.device, torch.float32)
        accumulate_(self.rows[index], values, inner, self.zero_bin, calls)
        self.pending = True
        return True

    def add_all(self, index: int, value: Any) -> None:
        """Add every tensor inside ``value`` (one module call's output) to row ``index``.

        The call counts once, however many tensors the output holds.
        """
        calls = 1
        for tensor in iter_tensors(value):
            if self.add(index, tensor, calls):
                calls = 0

    def drain(self, trainer: pl.Trainer | Any) -> list[list[float]]:
        """Reduce across ranks, copy to the host once, reset; every rank must call this together."""
        rows = self.rows
        if trainer.world_size > 1:
            rows = reduce_rows(trainer.strategy.all_gather(rows))
        host = rows.cpu().tolist()
        self.reset()
        return host

    def reset(self) -> None:
        """Empty every row, on device, without reading it."""
        self.rows.copy_(new_rows(self.rows.shape[0], self.edges.numel() - 1, self.rows.device))
        self.pending = False
