"""FeatureExtractor's host buffer: each output's rows since the last shard, their sample ids, the row limit.

The ids come from Lightning's prediction loop (:func:`batch_indices`).
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor


class FeatureBuffer:
    """The rows of each named output since the last shard, with the sample ids of each batch's rows.

    A batch's rows of an output get the batch's sample ids when there are as many rows as ids
    (the module ran once on the whole batch); an output that ever gets another count (a module
    called twice per batch) carries no ids from then on. ``max_rows`` caps each output's rows
    over the whole run: the batch that crosses it is cut, later ones are not kept.

    Args:
        max_rows: The most rows kept per output; None for no limit.
    """

    def __init__(self, max_rows: Optional[int]) -> None:
        self.max_rows = max_rows
        self.chunks: dict[str, list[Tensor]] = {}
        self.ids: dict[str, list[Tensor]] = {}
        self.without_ids: set[str] = set()
        self._shapes: dict[str, torch.Size] = {}
        self._batch_rows: dict[str, int] = {}
        self._kept: dict[str, int] = {}

    @property
    def batches(self) -> int:
        """The most chunks any output holds now: one per buffered batch and call."""
        return max((len(chunks) for chunks in self.chunks.values()), default=0)

    def full(self, name: str) -> bool:
        """Whether ``name`` has its ``max_rows`` rows already."""
        return self.max_rows is not None and self._kept.get(name, 0) >= self.max_rows

    def add(self, name: str, rows: Tensor) -> None:
        """Buffer ``rows`` of output ``name``.

        Raises:
            ValueError: If its shape past dim 0 differs from the earlier rows'.
        """
        expected = self._shapes.setdefault(name, rows.shape[1:])
        if rows.shape[1:] != expected:
            raise ValueError(
                f"its output {name!r} has shape {tuple(rows.shape)}, which differs past dim 0 from earlier"
                f" batches' (N, {', '.join(map(str, expected))}), so the rows cannot be concatenated"
            )
        self.chunks.setdefault(name, []).append(rows)
        self._batch_rows[name] = self._batch_rows.get(name, 0) + len(rows)

    def end_batch(self, indices: Optional[list[int]]) -> list[str]:
        """Give this batch's rows their sample ids (``indices``, None where unknown); apply the row limit.

        Returns:
            The outputs that lost their ids in this batch (their row count is not the batch's).
        """
        lost = []
        for name, count in self._batch_rows.items():
            if indices is not None and name not in self.without_ids:
                if count == len(indices):
                    self.ids.setdefault(name, []).append(torch.tensor(indices, dtype=torch.int64))
                else:
                    self.without_ids.add(name)
                    self.ids.pop(name, None)
                    lost.append(name)
            excess = self._kept.get(name, 0) + count - (self.max_rows if self.max_rows is not None else 1 << 62)
            if excess > 0:
                _cut(self.chunks[name], excess)
                if name in self.ids:
                    _cut(self.ids[name], excess)
            self._kept[name] = self._kept.get(name, 0) + count - max(excess, 0)
        self._batch_rows.clear()
        return lost

    def take(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Empty the buffer: each output's rows concatenated, and their ids where every row has one."""
        features = {name: torch.cat(chunks) for name, chunks in self.chunks.items() if chunks}
        ids = {name: torch.cat(self.ids[name]) for name in features
               if name in self.ids and name not in self.without_ids}
        self.chunks.clear()
        self.ids.clear()
        return features, ids


def _cut(chunks: list[Tensor], excess: int) -> None:
    """Drop the last ``excess`` rows of ``chunks``."""
    while excess > 0 and chunks:
        last = chunks.pop()
        if len(last) > excess:
            chunks.append(last[: len(last) - excess])
        excess -= len(last)


def batch_indices(trainer: pl.Trainer, batch_idx: int, dataloader_idx: int) -> Optional[list[int]]:
    """The dataset indices of this predict batch's samples, as Lightning records them for prediction writers.

    Lightning wraps each predict dataloader's batch sampler so that it keeps the indices of every
    batch it yields (``seen_batch_indices``); None where the loader is not a wrapped DataLoader.
    """
    loaders: Any = trainer.predict_dataloaders
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    loader = loaders[dataloader_idx] if isinstance(loaders, (list, tuple)) else loaders
    seen = getattr(getattr(loader, "batch_sampler", None), "seen_batch_indices", None)
    if seen is None or batch_idx >= len(seen):
        return None
    return [int(i) for i in seen[batch_idx]]
