"""Per-step stat buffers on device, reduced across ranks and moved to the host once per step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_hooks.stats import Bins, accumulate_, as_float_values, histogram_edges, new_rows, reduce_rows


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
        self._inner: dict[torch.device, Tensor] = {}
        self.rows = new_rows(len(names), self.edges.numel() - 1, device)
        self.pending = False

    def add(self, index: int, tensor: Tensor) -> None:
        """Add one tensor's statistics to row ``index``; tensors we cannot summarise are skipped."""
        values = as_float_values(tensor)
        if values is None:
            return
        inner = self._inner.get(values.device)
        if inner is None:
            inner = self._inner[values.device] = self.edges[1:-1].to(values.device, torch.float32)
        accumulate_(self.rows[index], values, inner, self.zero_bin)
        self.pending = True

    def drain(self, trainer: pl.Trainer | Any) -> list[list[float]]:
        """Reduce across ranks, copy to the host once, reset; every rank must call this together."""
        rows = self.rows
        if trainer.world_size > 1:
            rows = reduce_rows(trainer.strategy.all_gather(rows))
        host = rows.cpu().tolist()
        self.rows.copy_(new_rows(*self.rows.shape[:1], self.edges.numel() - 1, self.rows.device))
        self.pending = False
        return host
