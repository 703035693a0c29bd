"""How FeatureExtractor's outputs reach the disk: safetensors shards, a manifest, projector samples.

The layout of one stage is ``<dirpath>/<stage>/``:

- ``rank<r>-shard<k>.safetensors``: one file per rank and flush, holding for each saved output
  ``features/<name>`` (its rows) and, where the loop said which samples they are, their int64
  dataset indices: ``ids`` (shared by the outputs with the same ids, normally all) or ``ids/<name>``;
  its ``__metadata__`` says rank, shard, dataloader and which ids key each output's rows have.
  Each is written to a hidden temporary name and renamed, so a shard is whole or absent.
- ``manifest.json``: written by rank zero when the stage ends on every rank: outputs with their
  shapes, dtypes and rows, every shard with its rows, size and CRC-32, the ranks, the package,
  library and model versions. A set without it did not finish.

``_feature_reader`` reads them back.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import time
import zlib
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

Stage = Literal["train", "validate", "test", "predict"]
"""A stage by Lightning's ``RunningStage`` name; the folder its features go to."""

FORMAT = "lightning_hooks.features/1"
MANIFEST = "manifest.json"
#: Safetensors' names of the dtypes it stores.
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_WHY = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded (disk full for this user)",
        errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "permission denied"}


def stage_dir(dirpath: Union[str, os.PathLike], stage: str) -> Path:
    """Return the directory holding the shards and manifest of ``stage`` under ``dirpath``."""
    return Path(dirpath) / stage


def shard_name(rank: int, shard: int) -> str:
    """The file name of shard ``shard`` of rank ``rank``."""
    return f"rank{rank}-shard{shard:05d}.safetensors"


def disk_error(err: OSError, path: Union[str, os.PathLike], doing: str) -> OSError:
    """``err`` restated for a user: what could not be done to which file, and why in plain words.

    Example::

        raise disk_error(err, "features/predict/rank0-shard00003.safetensors", "write") from err
    """
    why = _WHY.get(err.errno or 0, err.strerror or str(err))
    return OSError(err.errno, f"FeatureExtractor could not {doing} {os.fspath(path)!r}: {why}"
                              f" ({err.strerror or err}). Free space, or pass a `dirpath` on a writable disk.")


def atomic_write(path: Path, data: Union[bytes, Sequence[Any]]) -> None:
    """Write ``data`` (bytes, or buffers one after another) to a hidden temporary name, then rename it to ``path``.

    The file is flushed and ``fsync``ed before the rename, so ``path`` is whole or absent.

    Raises:
        OSError: Saying "disk full" or "read-only" and naming ``path``; the temporary file is removed.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            parts: Sequence[Any] = [data] if isinstance(data, bytes) else data
            for part in parts:
                file.write(part)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as err:
        temporary.unlink(missing_ok=True)
        raise disk_error(err, path, "write") from err


def check_writable(dirpath: Union[str, os.PathLike]) -> None:
    """Create ``dirpath`` and write a small probe file in it, so a run fails before its first batch.

    Raises:
        OSError: Naming the directory and saying "disk full", "read-only" or "permission denied".
    """
    folder = Path(dirpath)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise disk_error(err, folder, "create the directory") from err
    atomic_write(folder / f".write-check-{os.getpid()}", b"\0" * 4096)
    (folder / f".write-check-{os.getpid()}").unlink()


class ShardWriter:
    """Writes one run of a stage by one rank: shards numbered from 0; this rank's old files deleted first.

    Args:
        dirpath: The extractor's ``dirpath``.
        stage: The stage being run.
        rank: This process's global rank.
        world_size: The number of processes in this run.
    """

    def __init__(self, dirpath: Union[str, os.PathLike], stage: str, rank: int, world_size: int) -> None:
        self.folder, self.rank, self.world_size = stage_dir(dirpath, stage), rank, world_size
        self.shards: list[dict[str, Any]] = []
        self.outputs: dict[str, dict[str, Any]] = {}
        check_writable(self.folder)
        for old in self.folder.iterdir():
            # Each rank deletes its own old files; rank 0 also the manifest and the files of ranks
            # that no longer exist (an earlier run with more processes).
            old_rank = _rank_of(old.name)
            if old_rank == rank or (rank == 0 and (old.name == MANIFEST or (old_rank or 0) >= world_size)):
                old.unlink()

    def write(self, features: dict[str, Tensor], ids: dict[str, Tensor], dataloader: int) -> None:
        """Save each output's rows (and their sample ids, where known) as this rank's next shard."""
        tensors = {f"features/{name}": rows.contiguous() for name, rows in features.items()}
        id_keys = _id_keys(ids)
        tensors.update({key: ids[name].to(torch.int64) for name, key in id_keys.items() if key not in tensors})
        meta = {"rank": str(self.rank), "shard": str(len(self.shards)), "dataloader": str(dataloader),
                "ids": json.dumps(id_keys)}
        parts = safetensors_parts(tensors, meta)
        name = shard_name(self.rank, len(self.shards))
        atomic_write(self.folder / name, parts)
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        self.shards.append({"file": name, "rank": self.rank, "shard": len(self.shards), "dataloader": dataloader,
                            "bytes": sum(memoryview(part).nbytes for part in parts), "crc32": crc,
                            "rows": {n: len(r) for n, r in features.items()}, "ids": id_keys})
        for output, rows in features.items():
            entry = self.outputs.setdefault(output, {"shape": list(rows.shape[1:]), "dtype": str(rows.dtype),
                                                     "rows": 0, "ids": True})
            entry["rows"] += len(rows)
            entry["ids"] &= output in ids

    def finish(self) -> None:
        """Write this rank's part of the manifest, ``rank<r>.json``, for rank zero to merge."""
        part = {"rank": self.rank, "shards": self.shards, "outputs": self.outputs}
        atomic_write(self.folder / f"rank{self.rank}.json", json.dumps(part).encode())


def safetensors_parts(tensors: dict[str, Tensor], metadata: dict[str, str]) -> list[Any]:
    """The bytes of a safetensors file of ``tensors``, as buffers to write one after another (the data not copied).

    The layout is safetensors' own: an 8-byte little-endian header size, the JSON header padded
    with spaces to 8 bytes, then each tensor's bytes, widest dtype first so each stays aligned.

    Raises:
        TypeError: If a tensor's dtype has no safetensors name (a complex tensor).
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    data, offset = [], 0
    for key in sorted(tensors, key=lambda k: (-tensors[k].element_size(), k)):
        tensor = tensors[key]
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"{key!r} is {tensor.dtype}, which safetensors cannot store: pass e.g. dtype=torch.float32")
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        header[key] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + raw.nbytes]}
        data.append(raw)
        offset += raw.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)), text, *data]


def _id_keys(ids: dict[str, Tensor]) -> dict[str, str]:
    """Where each output's ids go: ``"ids"``, shared by those with the first one's ids; else ``ids/<name>``."""
    if not ids:
        return {}
    shared = next(iter(ids.values()))
    return {name: "ids" if rows is shared or torch.equal(rows, shared) else f"ids/{name}"
            for name, rows in ids.items()}


def write_manifest(dirpath: Union[str, os.PathLike], stage: str, world_size: int, about: dict[str, Any]) -> Path:
    """Merge every rank's part into ``manifest.json`` (rank zero, once all ranks finished); delete the parts.

    Args:
        dirpath: The extractor's ``dirpath``.
        stage: The stage that ended.
        world_size: The number of processes that wrote.
        about: What else the manifest records: the watched modules, the model, the settings.
    """
    folder = stage_dir(dirpath, stage)
    parts = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world_size)]
    outputs: dict[str, dict[str, Any]] = {}
    for part in parts:
        for name, entry in part["outputs"].items():
            merged = outputs.setdefault(name, {**entry, "rows": 0, "ranks": []})
            merged["rows"] += entry["rows"]
            merged["ids"] = merged["ids"] and entry["ids"]
            merged["ranks"].append(part["rank"])
    manifest = {
        "format": FORMAT, "stage": stage, "complete": True,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "world_size": world_size, "ranks": list(range(world_size)), "outputs": dict(sorted(outputs.items())),
        "shards": [shard for part in parts for shard in part["shards"]], "versions": versions(), **about,
    }
    path = folder / MANIFEST
    atomic_write(path, json.dumps(manifest, indent=1, default=str).encode())
    for r in range(world_size):
        (folder / f"rank{r}.json").unlink(missing_ok=True)
    return path


def model_record(model: Any, checkpoint: Optional[Union[str, os.PathLike]], version: Optional[str]) -> dict[str, Any]:
    """What the manifest records of the model: class, parameter count, checkpoint, the user's version, hparams."""
    kind = type(model)
    return {"class": f"{kind.__module__}.{kind.__qualname__}", "version": version,
            "parameters": sum(p.numel() for p in model.parameters()),
            "checkpoint": None if checkpoint is None else os.fspath(checkpoint),
            "hparams": dict(getattr(model, "hparams", {}))}


def versions() -> dict[str, Optional[str]]:
    """The versions of this package and of the libraries that wrote the set."""
    found: dict[str, Optional[str]] = {}
    for package in ("lightning-hooks", "torch", "lightning", "safetensors"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def _rank_of(name: str) -> Optional[int]:
    """The rank a file of a stage folder belongs to (``rank3-shard…``, ``rank3.json``, ``.rank3-….tmp``)."""
    stem = name.lstrip(".")
    if not stem.startswith("rank"):
        return None
    digits = stem[4:].split("-", 1)[0].split(".", 1)[0]
    return int(digits) if digits.isdigit() else None


class EmbeddingSample:
    """A uniform random sample of ``size`` rows per output, logged to TensorBoard's embedding projector.

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
