"""CRC-32C of event records, for the package's own event files: in C where it was built, else with numpy.

Every record of an event file carries a masked CRC-32C of its bytes, and without TensorFlow
TensorBoard computes it in ``tensorboard.compat.tensorflow_stub.pywrap_tensorflow.crc32c``, one
Python loop iteration per byte (about 0.1-0.6 s per MB), on its writer thread but holding the
GIL. A logged step of a thousand modules' histograms is several MB. The package's own event
file (:mod:`lightning_hooks.output._event_file`) frames its records with :func:`masked` instead.

The optional C extension ``_crc32c_native`` (the SSE4.2 ``crc32`` instruction, or slicing-by-8
tables; about 0.1 ns a byte, the GIL released over large records) is used where it was built.
Without a C compiler, :func:`numpy_crc32c` cuts the bytes into equal chunks whose CRC registers
advance together, 4 bytes at a time (slicing-by-4 with two 16-bit tables), a few numpy
operations per column of words, and combines the chunks' registers with a precomputed table of
"advance over ``n`` zero bytes": about 4 ns a byte. Both give TensorBoard's checksum, bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np

try:  # The C checksum, built at install time where a C compiler is available.
    from lightning_hooks.output import _crc32c_native as native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    native = None



def _byte_table() -> list[int]:
    """The register of each byte after its 8 bits (the Castagnoli polynomial, bit-reversed)."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


CRC_TABLE = _byte_table()
_TABLE = np.asarray(CRC_TABLE, dtype=np.uint32)
_SMALL = 4096  # below this many bytes the per-byte loop is cheaper than the set-up


def _word_tables() -> tuple[np.ndarray, np.ndarray]:
    """Slicing-by-4, 16 bits a table: a register XOR the next 4 bytes x becomes low[x & 0xFFFF] ^ high[x >> 16]."""
    tables = [_TABLE]
    for _ in range(3):
        tables.append((tables[-1] >> 8) ^ _TABLE[tables[-1] & 0xFF])
    t0, t1, t2, t3 = tables
    v = np.arange(1 << 16, dtype=np.uint32)
    return t3[v & 0xFF] ^ t2[v >> 8], t1[v & 0xFF] ^ t0[v >> 8]


_LOW, _HIGH = _word_tables()


@functools.lru_cache(maxsize=64)
def _advance(zeros: int) -> np.ndarray:
    """``(4, 256)`` tables: byte ``j`` of a register equal to ``v`` becomes ``table[j, v]`` after ``zeros`` zero bytes.

    Feeding zero bytes is linear in the register, so the four lookups XORed advance any register;
    ``zeros`` is 4 times a power of two, each table made from the one of half as many.
    """
    if zeros == 4:
        crc = (np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None]).ravel()
        return (_LOW[crc & 0xFFFF] ^ _HIGH[crc >> 16]).reshape(4, 256)
    half = _advance(zeros // 2)
    return _apply(half, half.ravel()).reshape(4, 256)


def _apply(table: np.ndarray, crc: np.ndarray) -> np.ndarray:
    """Advance every register of ``crc`` by the zero bytes of ``table`` (see :func:`_advance`)."""
    return table[0, crc & 0xFF] ^ table[1, (crc >> 8) & 0xFF] ^ table[2, (crc >> 16) & 0xFF] ^ table[3, crc >> 24]


def _register(data: bytes) -> int:
    """The CRC-32C register after ``data`` from a register of 0 (no initial or final inversion).

    The data, led by zero bytes (which leave a zero register at zero), is cut into a power of
    two of 64-byte chunks; each chunk's register is computed from 0, all at once, 4 bytes at a
    step; then neighbours are combined, ``advance(left) ^ right``, halving the count each time.
    """
    chunks = 1 << (-(-len(data) // _CHUNK) - 1).bit_length()
    words = np.frombuffer(bytes(chunks * _CHUNK - len(data)) + data, dtype="<u4")
    words = words.reshape(chunks, _CHUNK // 4).T.copy()
    crc = np.zeros(chunks, dtype=np.uint32)
    for word in words:
        crc ^= word
        crc = _LOW[crc & 0xFFFF] ^ _HIGH[crc >> 16]
    span = _CHUNK
    while crc.size > 1:
        crc = _apply(_advance(span), crc[0::2]) ^ crc[1::2]
        span *= 2
    return int(crc[0])


_CHUNK = 64


def crc32c(data: bytes) -> int:
    """The CRC-32C (Castagnoli) of ``data``, as ``pywrap_tensorflow.crc32c`` gives it: in C where it was built."""
    return native.crc32c(data) if native is not None else numpy_crc32c(data)


def numpy_crc32c(data: bytes) -> int:
    """:func:`crc32c` with numpy, for a package built without a C compiler."""
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
    x = _per_byte(data) if native is None and len(data) < _SMALL else crc32c(data)
    return ((x >> 15) | (x << 17) & 0xFFFFFFFF) + 0xA282EAD8 & 0xFFFFFFFF

