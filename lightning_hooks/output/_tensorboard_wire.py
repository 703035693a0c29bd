"""TensorBoard events laid out from arrays: a step's histograms and scalars as one ``Summary``, built in bulk.

Building a ``HistogramProto`` field by field from Python lists costs about 25 us a histogram
(each bin a Python float converted on its own), and a model of a thousand modules logs a
thousand histograms a step. Here the protobuf wire bytes of the whole ``Summary`` are laid out
with numpy (every histogram's five figures in one array, the bins as slices of one buffer), and
the ``Event`` around them too, and handed to TensorBoard's writer thread as they are: the very
bytes protobuf serializes the field-by-field build to (``tests/test_sinks.py`` compares them),
at a few microseconds a histogram. Copying a parsed ``Summary`` into an ``Event`` and serializing
it, as ``FileWriter.add_summary`` does, cost as much again.
"""

from __future__ import annotations

import functools
import struct
import time
from collections.abc import Callable, Sequence

import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary

# Wire keys, (field number << 3) | wire type: 1 is 64-bit, 2 length-delimited, 5 32-bit.
_HISTOGRAM_FIGURES = ("min", "max", "count_finite", "sum", "sum_sq")  # HistogramProto fields 1-5, doubles
_FIGURE_KEYS = (0x09, 0x11, 0x19, 0x21, 0x29)
_BUCKET_LIMIT, _BUCKET = b"\x32", b"\x3a"  # HistogramProto fields 6 and 7: packed doubles
_TAG, _HISTO, _SIMPLE_VALUE = b"\x0a", b"\x2a", b"\x15"  # Summary.Value fields 1 (string), 5 (message), 2 (float)
_VALUE = b"\x0a"  # Summary field 1: repeated Value
_WALL_TIME, _STEP, _SUMMARY = b"\x09", b"\x10", b"\x2a"  # Event fields 1 (double), 2 (int64), 5 (message)
_HEAD = np.dtype([(f"k{i}", "u1") if j == 0 else (f"v{i}", "<f8") for i in range(5) for j in range(2)])


def _encode_varint(n: int) -> bytes:
    """``n`` (not negative) as a protobuf base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


#: :func:`_encode_varint`, for lengths (they repeat step after step: cached).
_varint = functools.lru_cache(maxsize=1 << 14)(_encode_varint)


def _field(key: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its key, the payload's length, the payload."""
    return key + _varint(len(payload)) + payload


@functools.lru_cache(maxsize=1 << 16)
def _tag_field(tag: str) -> bytes:
    """``Summary.Value``'s tag field (the tags repeat step after step: each encoded once)."""
    return _field(_TAG, tag.encode())


@functools.lru_cache(maxsize=1 << 16)
def _scalar_head(tag: str) -> bytes:
    """Everything of a scalar's ``Summary.Value`` field but its 4-byte float: key, length, tag, value key."""
    tag_field = _tag_field(tag)
    return _VALUE + _varint(len(tag_field) + 5) + tag_field + _SIMPLE_VALUE


@functools.lru_cache(maxsize=1 << 12)
def _bucket_keys(n_bins: int, figures: int) -> tuple[bytes, bytes, int]:
    """The keys and lengths of ``n_bins`` bucket limits and counts, and the HistogramProto's length with them."""
    size = _varint(8 * n_bins)
    return _BUCKET_LIMIT + size, _BUCKET + size, figures + 2 * (1 + len(size) + 8 * n_bins)


@functools.lru_cache(maxsize=1 << 16)
def _histogram_head(tag: str, length: int) -> bytes:
    """A histogram's ``Summary.Value`` up to its HistogramProto of ``length`` bytes: key, length, tag, key, length."""
    tag_field, histo_size = _tag_field(tag), _varint(length)
    return _VALUE + _varint(len(tag_field) + 1 + len(histo_size) + length) + tag_field + _HISTO + histo_size


def histogram_summary_bytes(tags: Sequence[str], figures: dict[str, np.ndarray], counts: np.ndarray,
                            edges: Sequence[float], spans: Sequence[tuple[int, int, int]]) -> bytes:
    """The wire bytes of a ``Summary`` holding a histogram per ``(row, first bin, one past the last)`` in ``spans``.

    Each is what ``torch.utils.tensorboard.summary.histogram_raw`` makes of the row's
    ``min``, ``max``, ``num`` (``count_finite``), ``sum``, ``sum_squares`` (``sum_sq``),
    ``bucket_limit`` (the right edges of the bins kept) and ``bucket`` (their counts), and the
    bytes are those protobuf serializes it to.

    Args:
        tags: One tag per row.
        figures: Per row: ``min``, ``max``, ``count_finite``, ``sum`` and ``sum_sq``.
        counts: ``(rows, bins)`` counts.
        edges: The ``bins + 1`` shared bin edges.
        spans: The rows to write and the bins of each to keep.
    """
    head = np.empty(len(tags), dtype=_HEAD)
    for i, (name, key) in enumerate(zip(_HISTOGRAM_FIGURES, _FIGURE_KEYS)):
        head[f"k{i}"], head[f"v{i}"] = key, figures[name]
    heads, width = head.tobytes(), _HEAD.itemsize
    # proto3 leaves out a double whose bits are all 0 (0.0, not -0.0): so do these bytes.
    zero: np.ndarray = np.stack([head[f"v{i}"].view(np.uint64) == 0 for i in range(5)], 1)
    any_zero: list[bool] = np.any(zero, axis=1).tolist()
    limits = np.asarray(edges, dtype="<f8").tobytes()
    bins = counts.shape[1]
    buckets = np.ascontiguousarray(counts, dtype="<f8").tobytes()
    values: list[bytes] = []
    for i, first, last in spans:
        figures_i = heads[i * width : (i + 1) * width]
        if any_zero[i]:
            figures_i = b"".join(figures_i[9 * j : 9 * j + 9] for j in range(5) if not zero[i, j])
        limit_key, bucket_key, length = _bucket_keys(last - first, len(figures_i))
        values += (_histogram_head(tags[i], length), figures_i, limit_key, limits[8 * (first + 1) : 8 * (last + 1)],
                   bucket_key, buckets[8 * (i * bins + first) : 8 * (i * bins + last)])
    return b"".join(values)


def histogram_summary(tags: Sequence[str], figures: dict[str, np.ndarray], counts: np.ndarray,
                      edges: Sequence[float], spans: Sequence[tuple[int, int, int]]) -> Summary:
    """:func:`histogram_summary_bytes` as a ``Summary`` message."""
    return Summary.FromString(histogram_summary_bytes(tags, figures, counts, edges, spans))


def scalar_summary_bytes(tags: Sequence[str], values: Sequence[float]) -> bytes:
    """The wire bytes of a ``Summary`` of ``simple_value`` scalars, as ``Summary.Value(tag=..., simple_value=...)``."""
    with np.errstate(over="ignore"):  # beyond float32 is +-inf, as protobuf stores it
        single = np.asarray(values, dtype=np.float64).astype("<f4")
    packed = single.tobytes()  # every value, 0.0 too: ``simple_value`` is in a oneof, so it is always written
    return b"".join(_scalar_head(tag) + packed[4 * i : 4 * i + 4] for i, tag in enumerate(tags))


def scalar_summary(tags: Sequence[str], values: Sequence[float]) -> Summary:
    """:func:`scalar_summary_bytes` as a ``Summary`` message."""
    return Summary.FromString(scalar_summary_bytes(tags, values))


def event_bytes(summary: bytes, step: int, wall_time: float) -> bytes:
    """The wire bytes of ``Event(summary=..., step=step, wall_time=wall_time)``, ``summary`` given as wire bytes."""
    wall = struct.pack("<d", wall_time)
    head = b"" if wall == bytes(8) else _WALL_TIME + wall  # proto3 leaves out a 0.0
    if step:
        head += _STEP + _encode_varint(step & 0xFFFFFFFFFFFFFFFF)  # int64: two's complement, 10 bytes if negative
    return head + _SUMMARY + _varint(len(summary)) + summary


def write_summary(queue: Callable[[bytes], None], summary: bytes, step: int) -> None:
    """Write a ``Summary`` given as wire bytes at ``step``, as torch's ``FileWriter.add_summary`` would.

    ``add_summary`` parses nothing but copies the summary into an ``Event`` and serializes it
    again: about 5 us a histogram, on the training thread. Here the event's bytes are laid out
    around the summary's and handed to ``queue``, the writer thread's (see
    :func:`~lightning_hooks.core._torch_internals.event_queue`), as ``add_event`` hands them.
    """
    queue(event_bytes(summary, step, time.time()))
