"""Gradients split across ranks (FSDP2's DTensors, FSDP1's flat shards): local shards, and sums over the shard groups.

Under ``fully_shard`` (and Lightning's ``ModelParallelStrategy``) each parameter and its
gradient is a ``DTensor``: every rank holds one shard (``Shard`` placement) of the whole
tensor, or a copy (``Replicate``). Under FSDP1 (``FullyShardedDataParallel``, Lightning's
``FSDPStrategy``, ``use_orig_params=True``) each parameter is a flat (1-D) view of this rank's
part of its unit's flat shard: the parts of all ranks make the whole parameter once, and a
part may be empty (its gradient is then None on that rank alone). Either way a figure of the
whole gradient is a sum of per-shard figures over the ranks that share the tensor out, and
only those (a sum over a replicated dimension would count each value once per copy). Working
on this rank's part and summing once per step keeps every figure a plain tensor: a DTensor
reduction would run one collective per parameter, and a collective on a DTensor raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_hooks.core._torch_internals import fsdp1_ignored_parameters
from lightning_hooks.measure._stat_rows import reduce_rows

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

#: The attribute :func:`note_flat_shards` sets on each parameter FSDP1 splits: its process group.
SHARD_GROUP_ATTRIBUTE = "_lightning_hooks_shard_group"


def note_flat_shards(model: nn.Module, who: Optional[str] = None) -> None:
    """Mark each parameter that FSDP1 splits across ranks with the process group it is split over.

    A parameter belongs to the innermost ``FullyShardedDataParallel`` unit that holds it; a
    unit that does not shard (``NO_SHARD``, or one rank) marks its parameters with None, and
    the parameters FSDP leaves alone (``ignored_modules``, ``ignored_states``: whole on every
    rank) are not marked. Call it on the outermost model (FSDP1's root unit wraps the
    LightningModule); calling it again is harmless. The mark is an attribute of the parameter
    (as FSDP marks its own), so it lives and dies with the parameter.

    Args:
        model: The model, or the FSDP1 root unit wrapping it.
        who: The callback, to warn (once, on rank zero) when FSDP1 runs with
            ``use_orig_params=False``: its flat parameters are figured whole, under FSDP's own
            names, padding included. None warns of nothing.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    except ImportError:  # pragma: no cover - torch built without distributed
        return
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    for unit in units:  # parents first: an inner unit's mark replaces its parent's
        group = unit.process_group
        splits = unit.sharding_strategy != ShardingStrategy.NO_SHARD and torch.distributed.get_world_size(group) > 1
        ignored = {id(p) for p in fsdp1_ignored_parameters(unit)}
        for param in unit.parameters():
            if id(param) not in ignored:
                setattr(param, SHARD_GROUP_ATTRIBUTE, group if splits else None)
    # The root unit's flat parameter sits on the module it wraps: look at the model's own names.
    if who is not None and any(name.rpartition(".")[2] == "_flat_param" for name, _ in model.named_parameters()):
        rank_zero_warn(
            f"{who}: this model is wrapped in FSDP1 with `use_orig_params=False`, so its optimizer holds one flat"
            " parameter per FSDP unit: gradient figures and transforms are of each unit's flat parameter (whole,"
            " across ranks, its padding included), named `..._flat_param`, and patterns naming modules inside"
            " a unit find no parameters there. Keep Lightning's default `use_orig_params=True` for"
            " per-parameter figures under your own names."
        )


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor."""
    return DTensor is not None and isinstance(tensor, DTensor)


def takes_gradient_directly(param: Tensor) -> bool:
    """Whether FSDP (2's DTensors, or 1's parameters) sets ``param``'s gradient, so no tensor hook on it fires."""
    return is_sharded(param) or hasattr(param, SHARD_GROUP_ATTRIBUTE)


def local(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, else the tensor itself."""
    kind = type(tensor)
    if kind is nn.Parameter or kind is Tensor:  # the usual case: no isinstance against DTensor (a few us a call)
        return tensor
    return tensor.to_local() if is_sharded(tensor) else tensor


def grad_of(param: Tensor) -> Optional[Tensor]:
    """``param``'s gradient on this rank; an empty one where FSDP1 split ``param`` and left it None.

    FSDP1 leaves ``.grad`` None where a rank's part of a parameter is empty, while the ranks
    holding the rest have a gradient (and on every rank for a parameter the step did not
    use). The figures' rows must be the same on every rank, so every trainable parameter
    FSDP1 splits has a row, empty where this rank has no gradient for it.
    """
    grad = param.grad
    if grad is None and param.requires_grad and _flat_group(param) is not None:
        return _empty(param)
    return grad


_EMPTY: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _empty(param: Tensor) -> Tensor:
    """An empty tensor of ``param``'s dtype and device, made once (it holds nothing, and is never written)."""
    key = (param.dtype, param.device)
    found = _EMPTY.get(key)
    if found is None:
        found = _EMPTY[key] = torch.empty(0, dtype=param.dtype, device=param.device)
    return found


def _flat_group(tensor: Tensor) -> Any:
    """The process group FSDP1 splits ``tensor`` over (see :func:`note_flat_shards`), or None."""
    return getattr(tensor, SHARD_GROUP_ATTRIBUTE, None)


def _sum_groups(tensor: Tensor) -> Optional[tuple[tuple[Any, ...], bool]]:
    """The process groups over which ``tensor``'s figures add up, and whether this rank leads.

    The leading rank holds the first part (to count a split tensor once). None if nothing adds up.
    """
    group = _flat_group(tensor)
    if group is not None:
        return (group,), torch.distributed.get_rank(group) == 0
    if not is_sharded(tensor):
        return None
    mesh = tensor.device_mesh
    dims = tuple(d for d, p in enumerate(tensor.placements) if p.is_shard() or p.is_partial())
    if not dims or mesh.size() == 1:
        return None
    coordinate = mesh.get_coordinate() or []
    # By process group, not mesh: each `mesh["dp"]` is a new mesh over the same group.
    return tuple(mesh.get_group(d) for d in dims), all(coordinate[d] == 0 for d in dims)


class ShardGroups:
    """Which tensors' figures add up over which process groups, worked out once per layout.

    Figures come in rows, one per tensor. Rows of plain tensors, and of DTensors that are only
    replicated, are left alone. Every rank must build it from the same tensors in the same
    order (as every rank's optimizer has).

    Args:
        tensors: The parameters (or, for DTensors, their gradients), one row each; FSDP1's
            parameters are known by the mark :func:`note_flat_shards` leaves on them.
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        keys: dict[tuple[Any, ...], list[int]] = {}
        self.leads = [True] * len(tensors)
        """Per row: whether this rank holds the first shard (to count a sharded tensor once)."""
        for row, tensor in enumerate(tensors):
            found = _sum_groups(tensor)
            if found is not None:
                groups, self.leads[row] = found
                keys.setdefault(groups, []).append(row)
        self.n_rows = len(tensors)
        self.distributed = any(is_sharded(tensor) for tensor in tensors)
        """Whether any tensor is a DTensor (replicated ones included): its gradient's local part is read."""
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
