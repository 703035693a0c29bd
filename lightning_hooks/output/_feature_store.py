"""How FeatureExtractor's outputs are kept: shards on disk, read back by ``load_features``; projector samples.

The layout is ``<dirpath>/<stage>/<layer>/rank<r>-shard<k>.pt``: one folder per stage and layer,
one file per rank and flush, each a tensor of that layer's outputs concatenated along dim 0.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, Optional, Union

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from lightning_hooks.core.selection import close_matches

Stage = Literal["train", "validate", "test", "predict"]
"""A stage by Lightning's ``RunningStage`` name; the folder its features go to."""

_SHARD = re.compile(r"rank(\d+)-shard(\d+)\.pt")


def layer_dir(dirpath: Union[str, os.PathLike], stage: str, layer: str) -> Path:
    """Return the directory holding the shards of ``layer`` for ``stage`` under ``dirpath``."""
    return Path(dirpath) / stage / layer


class ShardWriter:
    """Writes one run of a stage by one rank: shards numbered from 0, old ones of this rank deleted first.

    Args:
        dirpath: The extractor's ``dirpath``.
        stage: The stage being run.
        layers: The qualified names of the layers that will be written.
        rank: This process's global rank.
        world_size: The number of processes in this run.
    """

    def __init__(self, dirpath: Union[str, os.PathLike], stage: str, layers: Iterable[str], rank: int,
                 world_size: int) -> None:
        self.dirpath, self.stage, self.rank = dirpath, stage, rank
        self.shard = 0
        for layer in layers:
            folder = layer_dir(dirpath, stage, layer)
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.glob("rank*-shard*.pt"):
                # Each rank deletes its own old shards; rank 0 also those of ranks that no
                # longer exist (an earlier run with more processes).
                old_rank = int(old.name[len("rank") : old.name.index("-shard")])
                if old_rank == rank or (rank == 0 and old_rank >= world_size):
                    old.unlink()

    def write(self, chunks: dict[str, list[Tensor]]) -> dict[str, Tensor]:
        """Concatenate each layer's chunks and save them as this rank's next shard.

        Returns:
            The saved tensor of each layer that had chunks.
        """
        written = {}
        for layer, layer_chunks in chunks.items():
            if layer_chunks:
                features = torch.cat(layer_chunks)
                name = f"rank{self.rank}-shard{self.shard:05d}.pt"
                torch.save(features, layer_dir(self.dirpath, self.stage, layer) / name)
                written[layer] = features
        self.shard += 1
        return written


class EmbeddingSample:
    """A uniform random sample of ``size`` rows per layer, logged to TensorBoard's embedding projector.

    Each row gets a random key (from a generator seeded 0); the ``size`` smallest keys are kept.
    """

    def __init__(self, logger: TensorBoardLogger, size: int) -> None:
        self.logger, self.size = logger, size
        self._generator = torch.Generator().manual_seed(0)
        self._samples: dict[str, tuple[Tensor, Tensor]] = {}

    def add(self, layer: str, features: Tensor) -> None:
        """Offer ``features``' rows (flattened to float vectors) to the layer's sample."""
        keys = torch.rand(len(features), generator=self._generator)
        rows = features.reshape(len(features), -1).float()
        if layer in self._samples:
            kept_keys, kept_rows = self._samples[layer]
            keys, rows = torch.cat([kept_keys, keys]), torch.cat([kept_rows, rows])
        keep = keys.argsort()[: self.size]
        self._samples[layer] = (keys[keep], rows[keep])

    def log(self, stage: str, global_step: int) -> None:
        """Write each layer's sample as the embedding ``features/<stage>/<layer>``."""
        for layer, (_, rows) in self._samples.items():
            self.logger.experiment.add_embedding(rows, tag=f"features/{stage}/{layer}", global_step=global_step)


def load_features(
    dirpath: Union[str, os.PathLike], layer: str, stage: Stage = "predict", rank: Optional[int] = None
) -> Tensor:
    """Load the outputs a :class:`FeatureExtractor` saved for one layer, as one tensor.

    Shards are concatenated along dim 0 in order: by rank, then by shard index.

    Args:
        dirpath: The extractor's ``dirpath``.
        layer: The layer's qualified name, as in ``FeatureExtractor.module_names``.
        stage: The stage the features were extracted in (``"train"``, ``"validate"``, ``"test"`` or ``"predict"``).
        rank: Load only this rank's shards; None (the default) loads every rank's.

    Returns:
        The features, on CPU.

    Raises:
        FileNotFoundError: If nothing was saved for this layer, stage and rank: the message
            says whether the layer was watched but never called, suggests close names, and
            lists the layers that have features.

    Example::

        features = load_features("features", "encoder.2", stage="predict")

    """
    folder = layer_dir(dirpath, stage, layer)
    shards = sorted(
        (int(match[1]), int(match[2]), path)
        for path in (folder.iterdir() if folder.is_dir() else [])
        if (match := _SHARD.fullmatch(path.name)) and (rank is None or int(match[1]) == rank)
    )
    if not shards:
        raise FileNotFoundError(_not_saved_message(dirpath, stage, layer, rank))
    return torch.cat([torch.load(path, map_location="cpu", weights_only=True) for _, _, path in shards])


def _not_saved_message(dirpath: Union[str, os.PathLike], stage: str, layer: str, rank: Optional[int]) -> str:
    """Why nothing can be loaded for ``layer``: watched but never called, or never watched; what was saved."""
    which = "" if rank is None else f" by rank {rank}"
    stage_dir = Path(dirpath) / stage
    saved = sorted(p.name for p in stage_dir.iterdir() if _has_shards(p, rank)) if stage_dir.is_dir() else []
    head = f"No features saved{which} for layer {layer!r} in stage {stage!r} under {str(dirpath)!r}"
    if layer_dir(dirpath, stage, layer).is_dir():  # a FeatureExtractor watched it
        reason = f": it was watched, but no output of it was saved{which} (the module was never called)."
    else:
        close = close_matches(layer, saved)
        reason = "." + (f" Did you mean: {', '.join(repr(c) for c in close)}?" if close else "")
    return f"{head}{reason} Layers saved{which} for {stage!r}: {saved or 'none'}"


def _has_shards(folder: Path, rank: Optional[int]) -> bool:
    """Whether ``folder`` holds a shard (of ``rank``, unless it is None)."""
    return folder.is_dir() and any((match := _SHARD.fullmatch(path.name)) and (rank is None or int(match[1]) == rank)
                                   for path in folder.iterdir())
