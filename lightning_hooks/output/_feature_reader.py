"""Reading a feature set back: which shards are whole, one output's rows in dataset order, memory-mapped or streamed.

A set is complete when its ``manifest.json`` exists and every shard it lists is there with the
size it lists. Without ``allow_partial`` an incomplete set is refused; with it, every shard whose
safetensors header parses and whose size matches the header is read, and the others are named
in a warning. Only one output's tensors are read from a shard, never the others.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import safe_open
from torch import Tensor

from lightning_hooks.output._feature_store import DTYPE_NAMES, MANIFEST, stage_dir

_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass
class Shard:
    """One whole shard file: where it is, whose it is, and the rows of each output in it."""

    path: Path
    rank: int
    shard: int
    dataloader: int
    rows: dict[str, int]
    ids: dict[str, str]


@dataclass
class StageIndex:
    """What a stage folder holds: its whole shards, the manifest (None if the run did not finish)."""

    folder: Path
    shards: list[Shard]
    manifest: Optional[dict[str, Any]]

    def outputs(self, rank: Optional[int] = None) -> list[str]:
        """The outputs with rows (in shards of ``rank``, unless None), sorted."""
        return sorted({n for s in self.shards if rank is None or s.rank == rank for n, k in s.rows.items() if k})


def read_index(dirpath: Union[str, os.PathLike], stage: str, allow_partial: bool, verify: bool = False) -> StageIndex:
    """Find the whole shards of ``stage``; refuse an incomplete set unless ``allow_partial``.

    With ``verify`` each listed shard's CRC-32 is checked too (the whole file is read).

    Raises:
        FileNotFoundError: If the set has no manifest, or misses or has truncated shards the
            manifest lists, and ``allow_partial`` is False: the message says what is missing.
    """
    folder = stage_dir(dirpath, stage)
    files = sorted(folder.glob("rank*-shard*.safetensors")) if folder.is_dir() else []
    manifest_path = folder / MANIFEST
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        listed = [(folder / s["file"], s) for s in manifest["shards"]]
        bad = [p.name for p, s in listed if not p.is_file() or p.stat().st_size != s["bytes"]
               or (verify and zlib.crc32(p.read_bytes()) != s["crc32"])]
        if bad and not allow_partial:
            raise FileNotFoundError(
                f"The feature set in {str(folder)!r} is incomplete: {len(bad)} of the {len(listed)} shards its"
                f" manifest lists are missing, truncated or corrupt: {_few(bad)}. Pass allow_partial=True to read"
                f" the {len(listed) - len(bad)} whole ones."
            )
        whole = [_shard(p, s["rank"], s["shard"], s["dataloader"], s["rows"], s["ids"]) for p, s in listed
                 if p.name not in bad]
    else:
        manifest, whole, bad = None, [], []
        for path in files:
            found = _scan(path)
            (whole.append(found) if found is not None else bad.append(path.name))
        if files and not allow_partial:
            ranks = sorted({s.rank for s in whole})
            raise FileNotFoundError(
                f"The feature set in {str(folder)!r} is incomplete: it has no {MANIFEST}, so the run that"
                f" wrote it did not finish (killed, failed, or still running). It holds {len(whole)} whole"
                f" shards from ranks {ranks}" + (f" and {len(bad)} truncated ones ({_few(bad)})" if bad else "")
                + ". Pass allow_partial=True to read the whole ones, or run the stage again."
            )
    if bad:
        warnings.warn(f"load_features: skipping {len(bad)} incomplete shards in {str(folder)!r}: {_few(bad)}",
                      stacklevel=3)
    return StageIndex(folder, sorted(whole, key=lambda s: (s.rank, s.shard)), manifest)


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _shard(path: Path, rank: int, shard: int, dataloader: int, rows: dict[str, int], ids: dict[str, str]) -> Shard:
    return Shard(path, int(rank), int(shard), int(dataloader), dict(rows), dict(ids))


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header of ``path`` and the offset its data starts at.

    Raises:
        ValueError: If the header is cut off or not JSON.
    """
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        text = file.read(size)
    if len(text) < size:
        raise ValueError("header cut off")
    return json.loads(text), 8 + size


def _scan(path: Path) -> Optional[Shard]:
    """The shard at ``path`` from its own header, or None where it is truncated or unreadable."""
    try:
        header, start = _header(path)
        meta = header.pop("__metadata__", {})
        end = max((t["data_offsets"][1] for t in header.values()), default=0)
        if path.stat().st_size < start + end:
            return None
        rows = {k.split("/", 1)[1]: t["shape"][0] for k, t in header.items() if k.startswith("features/")}
        return _shard(path, meta["rank"], meta["shard"], meta["dataloader"], rows, json.loads(meta["ids"]))
    except (OSError, ValueError, KeyError, IndexError):
        return None


def read_tensor(path: Path, key: str, mmap: bool) -> Tensor:
    """Read one tensor of a shard: memory-mapped (pages read when touched, copy-on-write), or copied in whole.

    Only ``key``'s bytes are read; the file's other tensors are not.
    """
    if not mmap:
        with safe_open(path, framework="pt") as file:
            return file.get_tensor(key)
    header, start = _header(path)
    entry = header[key]
    dtype, (begin, end) = _DTYPES[entry["dtype"]], entry["data_offsets"]
    mapped = torch.from_file(os.fspath(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
    raw = mapped[start + begin: start + end]
    if raw.storage_offset() % dtype.itemsize:  # unaligned (a file not written by us): copy
        raw = raw.clone()
    return raw.view(dtype).reshape(entry["shape"])


def iter_shards(index: StageIndex, output: str, rank: Optional[int], dataloader_idx: Optional[int],
                mmap: bool) -> Iterator[tuple[Shard, Tensor, Optional[Tensor]]]:
    """Yield each shard with rows of ``output``, its rows and their ids (None where unknown), in saved order."""
    for shard in index.shards:
        if not shard.rows.get(output) or (rank is not None and shard.rank != rank):
            continue
        if dataloader_idx is not None and shard.dataloader != dataloader_idx:
            continue
        ids = read_tensor(shard.path, shard.ids[output], mmap=False) if output in shard.ids else None
        yield shard, read_tensor(shard.path, f"features/{output}", mmap), ids
