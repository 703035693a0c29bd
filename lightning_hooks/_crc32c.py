"""CRC-32C of TensorBoard's event records, vectorised with numpy.

Every record TensorBoard writes carries a CRC-32C of its bytes, and without TensorFlow it is
computed by ``tensorboard.compat.tensorflow_stub.pywrap_tensorflow.crc32c``, one Python loop
iteration per byte: about 0.1 s per MB, on the writer's thread but holding the GIL. A logged step
of a thousand histograms is about 2 MB, so that checksum alone cost more host time than
everything else a logged step does. Here the bytes are cut into equal chunks whose CRC
registers advance together, one numpy operation per byte column, and the chunks' registers are
then combined with a precomputed table of "advance over ``n`` zero bytes": the same checksum, bit
for bit, about ten times faster on large records.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import CRC_TABLE, masked_crc32c
from tensorboard.summary.writer.record_writer import RecordWriter

_TABLE = np.asarray(CRC_TABLE, dtype=np.uint32)
_SMALL = 4096  # below this many bytes the per-byte loop is cheaper than the set-up


@functools.lru_cache(maxsize=16)
def _advance(zeros: int) -> list[list[int]]:
    """``(4, 256)`` tables: byte ``j`` of a register equal to ``v`` becomes ``table[j, v]`` after ``zeros`` zero bytes.

    Feeding zero bytes is linear in the register, so the four lookups XORed advance any register.
    """
    crc = (np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None]).ravel()
    for _ in range(zeros):
        crc = _TABLE[crc & 0xFF] ^ (crc >> 8)
    return crc.reshape(4, 256).tolist()


def _register(data: bytes) -> int:
    """The CRC-32C register after ``data`` from a register of 0 (no initial or final inversion)."""
    chunk = max(256, int(0.3 * len(data) ** 0.5))
    pad = -len(data) % chunk  # leading zero bytes leave a zero register at zero
    columns = np.frombuffer(b"\0" * pad + data, dtype=np.uint8).reshape(-1, chunk).T.astype(np.uint32)
    crc = np.zeros(columns.shape[1], dtype=np.uint32)
    for column in columns:  # every chunk advances by one byte at once
        crc = _TABLE[(crc ^ column) & 0xFF] ^ (crc >> 8)
    byte0, byte1, byte2, byte3 = _advance(chunk)
    out = 0
    for part in crc.tolist():  # out = advance(out) ^ part, chunk by chunk
        out = byte0[out & 0xFF] ^ byte1[(out >> 8) & 0xFF] ^ byte2[(out >> 16) & 0xFF] ^ byte3[out >> 24] ^ part
    return out


def crc32c(data: bytes) -> int:
    """The CRC-32C (Castagnoli) of ``data``, as ``pywrap_tensorflow.crc32c`` gives it."""
    if len(data) < 4:
        return _per_byte(data)
    # A register starting at 0xFFFFFFFF is one starting at 0 over data whose first 4 bytes are inverted.
    return _register(bytes(b ^ 0xFF for b in data[:4]) + data[4:]) ^ 0xFFFFFFFF


def _per_byte(data: bytes) -> int:
    """The CRC-32C of ``data`` by the per-byte loop."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked(data: bytes) -> int:
    """TensorBoard's masked CRC-32C of a record's bytes (``pywrap_tensorflow.masked_crc32c``)."""
    if len(data) < _SMALL:
        return int(masked_crc32c(data))
    x = crc32c(data)
    return ((x >> 15) | (x << 17) & 0xFFFFFFFF) + 0xA282EAD8 & 0xFFFFFFFF


class FastRecordWriter(RecordWriter):
    """TensorBoard's ``RecordWriter`` with the vectorised checksum: the same bytes in the event file."""

    def write(self, data: bytes) -> None:
        """Write one record: its length, the length's masked CRC, the data, the data's masked CRC."""
        header = len(data).to_bytes(8, "little")
        self._writer.write(header + masked(header).to_bytes(4, "little") + data + masked(data).to_bytes(4, "little"))


def speed_up(event_file_writer: Any) -> None:
    """Have ``event_file_writer`` (tensorboard's ``EventFileWriter``) checksum its records with :func:`masked`.

    Its record writer becomes a :class:`FastRecordWriter`; one of another kind is left alone.
    """
    async_writer = getattr(event_file_writer, "_async_writer", None)
    record_writer = getattr(async_writer, "_writer", None)
    if type(record_writer) is RecordWriter:
        record_writer.__class__ = FastRecordWriter
