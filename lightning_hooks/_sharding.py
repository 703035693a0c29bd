"""Gradients split across ranks (FSDP2's DTensors): local shards, and sums over the shard groups.

Under ``fully_shard`` (and Lightning's ``ModelParallelStrategy``) each parameter and its
gradient is a ``DTensor``: every rank holds one shard (``Shard`` placement) of the whole
tensor, or a copy (``Replicate``). A figure of the whole gradient is a sum of per-shard
figures over the mesh dimensions that shard it, and only those (a sum over a replicated
dimension would count each value once per copy). Working on ``to_local()`` and summing once
per step keeps every figure a plain tensor: a DTensor reduction would run one collective per
parameter, and a collective on a DTensor raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_hooks.stats import reduce_rows

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


def warn_if_flat_sharded(model: nn.Module, who: str) -> None:
    """Warn (once, on rank zero) that FSDP1's flat shards give per-rank gradient figures.

    ``FullyShardedDataParallel`` keeps each rank's part of many parameters in one flat shard
    whose layout is private to it, so norms there are of a rank's shard, not the whole gradient.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        rank_zero_warn(
            f"{who}: this model is wrapped in FSDP1 (`FullyShardedDataParallel`, strategy='fsdp'), whose flat"
            " shards are not understood: gradient norms, norm thresholds and clipping see each rank's shard,"
            " not the whole gradient (NaN/Inf detection still works across ranks). Use"
            " `ModelParallelStrategy` with `fully_shard` (FSDP2) for whole-gradient figures."
        )


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor."""
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def _sum_dims(tensor: Tensor) -> Optional[tuple[Any, tuple[int, ...]]]:
    """The mesh and the mesh dimensions over which ``tensor``'s shards add up; None if none do."""
    if not is_sharded(tensor):
        return None
    dims = tuple(d for d, p in enumerate(tensor.placements) if p.is_shard() or p.is_partial())
    return (tensor.device_mesh, dims) if dims and tensor.device_mesh.size() > 1 else None


class ShardGroups:
    """Which tensors' figures add up over which process groups, worked out once per layout.

    Figures come in rows, one per tensor. Rows of plain tensors, and of DTensors that are only
    replicated, are left alone. Every
    rank must build it from the same tensors in the same order (as every rank's optimizer has).

    Args:
        tensors: The gradients (or parameters), one row each.
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        keys: dict[tuple[Any, ...], list[int]] = {}
        self.leads = [True] * len(tensors)
        """Per row: whether this rank holds the first shard (to count a sharded tensor once)."""
        for row, tensor in enumerate(tensors):
            found = _sum_dims(tensor)
            if found is not None:
                mesh, dims = found
                # By process group, not mesh: each `mesh["dp"]` is a new mesh over the same group.
                keys.setdefault(tuple(mesh.get_group(d) for d in dims), []).append(row)
                coordinate = mesh.get_coordinate() or []
                self.leads[row] = all(coordinate[d] == 0 for d in dims)
        self.n_rows = len(tensors)
        self._groups = [(group, rows) for groups, rows in keys.items() for group in groups]
        self._index: dict[int, Tensor] = {}

    @property
    def sharded(self) -> bool:
        """Whether any tensor is split across ranks."""
        return bool(self._groups)

    def sum_(self, rows: Tensor) -> Tensor:
        """Sum the rows of ``rows`` (dim 0, one per tensor) over their shard groups, in place.

        One collective per group of tensors sharded alike (one in all under ``fully_shard`` on
        one mesh), whatever the number of tensors; no host synchronisation.
        """
        for group, index in self._parts(rows.device):
            part = rows if index is None else rows.index_select(0, index)
            torch.distributed.all_reduce(part, group=group)
            if index is not None:
                rows.index_copy_(0, index, part)
        return rows

    def reduce_stat_rows_(self, rows: Tensor) -> Tensor:
        """Combine stat rows (one per tensor) over their shard groups, in place: sums add, extremes max.

        One ``all_gather`` per group of tensors sharded alike.
        """
        for group, index in self._parts(rows.device):
            part = rows if index is None else rows.index_select(0, index)
            gathered = [torch.empty_like(part) for _ in range(torch.distributed.get_world_size(group))]
            torch.distributed.all_gather(gathered, part.contiguous(), group=group)
            combined = reduce_rows(torch.stack(gathered))
            if index is None:
                rows.copy_(combined)
            else:
                rows.index_copy_(0, index, combined)
        return rows

    def _parts(self, device: torch.device) -> list[tuple[Any, Optional[Tensor]]]:
        """Each process group with the rows it sums: None for all rows (no index to move)."""
        parts: list[tuple[Any, Optional[Tensor]]] = []
        for group, rows in self._groups:
            if len(rows) == self.n_rows:
                parts.append((group, None))
                continue
            index = self._index.get(id(rows))
            if index is None or index.device != device:
                index = self._index[id(rows)] = torch.tensor(rows, device=device)
            parts.append((group, index))
        return parts


class ShardGroupCache:
    """:class:`ShardGroups` per list of tensors, worked out once per list (the optimizer's lists are stable)."""

    def __init__(self) -> None:
        self._found: dict[tuple[int, ...], ShardGroups] = {}

    def __call__(self, tensors: Sequence[Tensor]) -> ShardGroups:
        """The shard groups of ``tensors``, from the cache when these same tensors were seen before."""
        key = tuple(map(id, tensors))
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = ShardGroups(tensors)
        return found

    def clear(self) -> None:
        """Forget every list (at the end of a fit: the ids may be reused)."""
        self._found.clear()
