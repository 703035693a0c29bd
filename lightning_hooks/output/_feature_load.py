"""The public way back to saved features: ``load_features``, ``iter_features``, ``MappedFeatures``."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union, get_args

import torch
from torch import Tensor

from lightning_hooks.core._validation import check_choice
from lightning_hooks.core.selection import close_matches
from lightning_hooks.output._feature_reader import StageIndex, iter_shards, read_index
from lightning_hooks.output._feature_store import Stage

#: Keys of (dataloader, sample id) pairs: dataloader * _LOADER + id.
_LOADER = 2**40


class MappedFeatures:
    """One output's saved rows, memory-mapped shard by shard: rows are read from disk when indexed.

    Rows are in dataset order (by sample id, as :func:`load_features` orders them) where every shard
    has ids, else in saved order (by rank, then shard). ``features[i]``, ``features[a:b]`` and
    ``features[tensor_of_positions]`` return ordinary tensors holding just those rows;
    :meth:`by_id` looks rows up by sample id. Returned by ``load_features(..., mmap=True)``.

    Example::

        features = load_features("features", "encoder.2", mmap=True)
        first = features[:1000]                    # reads about 1000 rows from disk
        neighbours = features.by_id(torch.tensor([17, 4]))
    """

    def __init__(self, parts: Sequence[Tensor], destinations: Sequence[Tensor], rows: int,
                 ids: Optional[Tensor]) -> None:
        self._parts = list(parts)
        self._part = torch.empty(rows, dtype=torch.int64)
        self._row = torch.empty(rows, dtype=torch.int64)
        for number, destination in enumerate(destinations):
            kept = destination >= 0
            self._part[destination[kept]] = number
            self._row[destination[kept]] = torch.arange(len(destination))[kept]
        self.ids = ids
        self.shape = torch.Size((rows, *self._parts[0].shape[1:]))
        self.dtype = self._parts[0].dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Union[int, slice, Tensor]) -> Tensor:
        positions = torch.arange(len(self))[index]
        single = positions.dim() == 0
        positions = positions.reshape(-1)
        out = torch.empty((len(positions), *self.shape[1:]), dtype=self.dtype)
        parts, rows = self._part[positions], self._row[positions]
        for number in parts.unique().tolist():
            chosen = parts == number
            out[chosen] = self._parts[number][rows[chosen]]
        return out[0] if single else out

    def by_id(self, ids: Union[Sequence[int], Tensor]) -> Tensor:
        """Return the rows of the samples with dataset indices ``ids``, in that order (an id's first row, if repeated).

        Raises:
            KeyError: If the rows carry no sample ids, or an id was not saved.
        """
        if self.ids is None:
            raise KeyError("these rows carry no sample ids (only `predict` records them); index them by position")
        wanted = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        positions = torch.searchsorted(self.ids, wanted).clamp(max=len(self.ids) - 1)
        missing = wanted[self.ids[positions] != wanted]
        if len(missing):
            raise KeyError(f"sample ids not saved: {missing[:10].tolist()}")
        return self[positions]


def load_features(
    dirpath: Union[str, os.PathLike], layer: str, stage: Stage = "predict", rank: Optional[int] = None, *,
    dataloader_idx: Optional[int] = None, return_ids: bool = False, mmap: bool = False, allow_partial: bool = False,
    verify: bool = False,
) -> Any:
    """Load the rows a :class:`FeatureExtractor` saved for one output, in dataset order where it can.

    Where the rows carry sample ids (``predict`` records them from Lightning's batch indices,
    any stage from ``sample_ids``) they come back sorted by id (by dataloader, then id): row ``i``
    is the sample ``ids[i]``, on one process or many. In ``predict``, the repeats a distributed
    sampler pads with (an id saved by two ranks) are dropped; every other repeat (each epoch of
    ``train``, an id ``sample_ids`` gives twice) is kept, an id's rows in saved order. Without ids
    they come in saved order: by rank, then shard. Only this output's tensors are read.

    Args:
        dirpath: The extractor's ``dirpath``.
        layer: The output's name: a module's qualified name, or ``"<module>:<key>"`` for a tensor
            inside a structured output (``"lstm:0"``, ``"encoder:hidden"``).
        stage: The stage the features were extracted in: ``"train"``, ``"validate"``, ``"test"`` or ``"predict"``.
        rank: Load only this rank's rows; None (the default) loads every rank's.
        dataloader_idx: Load only the rows of this dataloader; None loads every dataloader's.
        return_ids: Also return the sample ids: ``(features, ids)``; ids is None where unknown.
        mmap: Return a :class:`MappedFeatures` that reads rows from disk when indexed, instead of a tensor.
        allow_partial: Read the whole shards of a set that did not finish (no manifest) or lost
            shards, with a warning naming those skipped, instead of refusing it.
        verify: Check each shard against the CRC-32 in the manifest (reads every file whole);
            a shard that fails counts as missing.

    Returns:
        The rows, on CPU (a :class:`MappedFeatures` with ``mmap``); with ``return_ids``, ``(rows, ids)``.

    Raises:
        ValueError: If ``stage`` is not one of the four stages (``TypeError`` if not a string).
        FileNotFoundError: If the set is incomplete (the message says what is missing) and not
            ``allow_partial``; or nothing was saved for this output: the message says whether the
            module was watched but never called, suggests close names and lists what was saved.

    Example::

        features, ids = load_features("features", "encoder.2", return_ids=True)

    """
    _check_stage(stage)
    index = read_index(dirpath, stage, allow_partial, verify)
    parts = list(iter_shards(index, layer, rank, dataloader_idx, mmap))
    if not parts:
        raise FileNotFoundError(_not_saved_message(index, dirpath, stage, layer, rank))
    rows = [features for _, features, _ in parts]
    destinations, ids = _dataset_order(parts, stage)
    total = len(ids) if ids is not None else sum(map(len, rows))
    if mmap:
        result: Any = MappedFeatures(rows, destinations, total, ids)
    else:
        result = torch.empty((total, *rows[0].shape[1:]), dtype=rows[0].dtype)
        for destination, part in zip(destinations, rows):
            kept = destination >= 0
            result[destination[kept]] = part if bool(kept.all()) else part[kept]
    return (result, ids) if return_ids else result


def iter_features(
    dirpath: Union[str, os.PathLike], layer: str, stage: Stage = "predict", rank: Optional[int] = None, *,
    dataloader_idx: Optional[int] = None, mmap: bool = False, allow_partial: bool = False, verify: bool = False,
) -> Iterator[tuple[Tensor, Optional[Tensor]]]:
    """Stream one output's rows shard by shard, for sets bigger than memory: ``(rows, ids)`` per shard.

    Shards come in saved order (by rank, then shard); ids is None where the rows carry none.
    Arguments as :func:`load_features`; one shard is in memory at a time (none with ``mmap``).

    Raises:
        ValueError: If ``stage`` is not one of the four stages (``TypeError`` if not a string).
        FileNotFoundError: As :func:`load_features`, when the iteration starts.

    Example::

        total = sum(rows.double().sum(0) for rows, _ in iter_features("features", "encoder.2"))

    """
    _check_stage(stage)
    index = read_index(dirpath, stage, allow_partial, verify)
    if not any(s.rows.get(layer) and (rank is None or s.rank == rank) for s in index.shards):
        raise FileNotFoundError(_not_saved_message(index, dirpath, stage, layer, rank))
    return ((rows, ids) for _, rows, ids in iter_shards(index, layer, rank, dataloader_idx, mmap))


def _check_stage(stage: Any) -> None:
    """Raise unless ``stage`` names one of the four stages; ``"fit"`` is told where its rows are."""
    if stage == "fit":
        raise ValueError("`stage` must be one of ['train', 'validate', 'test', 'predict'], got 'fit': the rows"
                         " `Trainer.fit` saves are under stage='train'")
    check_choice("stage", stage, get_args(Stage))


def _dataset_order(parts: list[Any], stage: str) -> tuple[list[Tensor], Optional[Tensor]]:
    """Where each part's rows go (-1: dropped): stably sorted by (dataloader, id), or in saved order.

    Only a distributed sampler's padding is dropped: in ``predict``, an id saved by an earlier rank
    is dropped from the later ranks. Every other repeat (a later epoch, a second run) is kept, after
    the earlier rows of that id, in saved order.
    """
    counts = [len(features) for _, features, _ in parts]
    if any(ids is None for *_, ids in parts):
        return list(torch.arange(sum(counts)).split(counts)), None
    keys = torch.cat([ids + shard.dataloader * _LOADER for shard, _, ids in parts])
    keep = torch.ones(len(keys), dtype=torch.bool)
    if stage == "predict":
        ranks = torch.cat([torch.full((n,), shard.rank) for (shard, _, _), n in zip(parts, counts)])
        _, inverse = torch.unique(keys, return_inverse=True)
        first = torch.full((int(inverse.max()) + 1,), 2**62).scatter_reduce(0, inverse, ranks, "amin")
        keep = ranks == first[inverse]
    order = torch.sort(keys[keep], stable=True).indices
    destination = torch.full((len(keys),), -1)
    destination[keep.nonzero().squeeze(1)[order]] = torch.arange(len(order))
    return list(destination.split(counts)), keys[keep][order] % _LOADER


def _not_saved_message(index: StageIndex, dirpath: Union[str, os.PathLike], stage: str, layer: str,
                       rank: Optional[int]) -> str:
    """Why nothing can be loaded for ``layer``: watched but never called, saved under other names, or never watched."""
    which = "" if rank is None else f" by rank {rank}"
    saved = index.outputs(rank)
    head = f"No features saved{which} for {layer!r} in stage {stage!r} under {str(dirpath)!r}"
    inside = [name for name in saved if name.startswith(f"{layer}:")]
    watched = (index.manifest or {}).get("watched", [])
    if inside:
        reason = f": it returns a structured output, whose tensors are saved as {inside}; load one of those."
    elif layer in watched:
        reason = f": it was watched, but no output of it was saved{which} (the module was never called)."
    else:
        close = close_matches(layer, saved)
        reason = "." + (f" Did you mean: {', '.join(repr(c) for c in close)}?" if close else "")
    return f"{head}{reason} Outputs saved{which} for {stage!r}: {saved or 'none'}"
