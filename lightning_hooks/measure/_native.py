"""The fused C statistics kernel (``_cstats.c``) as the torch custom op ``lightning_hooks::accumulate_f32``.

The op takes tensors, never addresses: its CPU implementation hands the C code each tensor's numpy
view (zero copy), which the C code reads through the buffer protocol, checking item formats,
contiguity and the row's length against the bins. A fake implementation (the op returns nothing and
writes only ``row``) lets ``torch.compile`` trace it as one opaque call, so compiled hooks run the C
kernel too. Without a build (no C compiler at install time), or with a build left over from older
sources, nothing is registered and :data:`NATIVE_KERNEL` is False.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from lightning_hooks.core._torch_internals import in_torch_func, torch_modes_on

__all__ = ["NATIVE_ABI", "NATIVE_KERNEL", "DirectKernel", "accumulate_native_", "cstats", "native_table"]

NATIVE_ABI = 5  # _cstats.c's ABI_VERSION: a build left over from older sources is not used
try:  # The fused CPU kernel, built at install time where a C compiler is available.
    from lightning_hooks.measure import _cstats as cstats  # type: ignore[attr-defined]

    if getattr(cstats, "ABI_VERSION", None) != NATIVE_ABI:
        warnings.warn(
            "lightning_hooks: the compiled statistics kernel was built from older sources and is not used"
            " (statistics on the CPU are about 10x slower without it); rebuild it with `pip install -e .`",
            stacklevel=2,
        )
        cstats = None
except ImportError:  # pragma: no cover - depends on the build
    cstats = None

#: Whether float32 CPU tensors go through the fused native kernel (same figures, ~10x faster).
#: Set ``LIGHTNING_HOOKS_NATIVE=0`` to use the tensor-op kernel everywhere.
NATIVE_KERNEL: bool = cstats is not None and os.environ.get("LIGHTNING_HOOKS_NATIVE", "1") != "0"

_SCHEMA = "accumulate_f32(Tensor values, Tensor(a!) row, Tensor table, Tensor right, bool fine, float calls) -> ()"


def _accumulate_cpu(values: Tensor, row: Tensor, table: Tensor, right: Tensor, fine: bool, calls: float) -> None:
    """The op on the CPU: the C kernel over the tensors' numpy views, on torch's CPU thread count."""
    cstats.accumulate_f32(values.detach().numpy(), row.numpy(), table.numpy(), right.numpy(), fine, calls,
                          torch.get_num_threads())


def _accumulate_fake(values: Tensor, row: Tensor, table: Tensor, right: Tensor, fine: bool, calls: float) -> None:
    """The op under tracing: no output; ``row`` is written in place (declared in the schema)."""


if cstats is not None:
    # Library.define/impl (torch >= 2.1) rather than torch.library.custom_op (>= 2.4): the package
    # supports torch 2.3; the fake implementation's registration was renamed in 2.4.
    _LIBRARY = torch.library.Library("lightning_hooks", "FRAGMENT")
    _LIBRARY.define(_SCHEMA)
    _LIBRARY.impl("accumulate_f32", _accumulate_cpu, "CPU")
    _register_fake = getattr(torch.library, "register_fake", None) or torch.library.impl_abstract
    _register_fake("lightning_hooks::accumulate_f32", _accumulate_fake, lib=_LIBRARY)


def accumulate_native_(values: Tensor, row: Tensor, table: Tensor, right: Tensor, fine: bool, calls: float) -> None:
    """Add the statistics of contiguous float32 CPU ``values`` into the float64 stat ``row``, in place.

    Always through the dispatcher (about 3 us per call more than calling the implementation
    directly): ``torch.func`` transforms unwrap their tensors there, and under ``torch.compile``
    dynamo records the call as one node that the compiled graph calls.
    """
    torch.ops.lightning_hooks.accumulate_f32(values, row, table, right, fine, calls)


class DirectKernel:
    """The C kernel called without the dispatcher, into a block of stat rows on the CPU: the eager hot path.

    Through the op a call costs about 11 us besides the kernel's own time (the dispatcher, a
    numpy view of each of four tensors, the checks of ``stats.accumulate_``), about 30 us per
    module of a logged step of the quick start, three calls per module. Here the block's, the
    table's and the edges' numpy views are made once, and a call costs one view of the values
    and a few checks, about 1.5 us. It takes only what the op's CPU implementation would be
    given as it is: a plain, contiguous, non-empty float32 CPU tensor, in eager code outside
    ``torch.func`` transforms and torch modes (:meth:`takes`); the caller sends anything else
    through the op, where transforms unwrap their tensors and ``torch.compile`` sees the call.

    Args:
        rows: The block of stat rows, float64, contiguous, on the CPU.
        table: The bin table of :func:`native_table`.
        right: The bins' right edges, float32.
        fine: Whether one comparison per value suffices (from :func:`native_table`).
    """

    def __init__(self, rows: Tensor, table: Tensor, right: Tensor, fine: bool) -> None:
        self.rows, self.table, self.right, self.fine = rows.numpy(), table.numpy(), right.numpy(), fine

    @staticmethod
    def eager() -> bool:
        """Whether code runs eagerly: not traced by ``torch.compile``, and no torch function or dispatch mode on."""
        return not torch.compiler.is_compiling() and not torch_modes_on()

    @staticmethod
    def readable(tensor: Tensor) -> bool:
        """Whether the kernel reads ``tensor`` as it is: a plain, contiguous, non-empty float32 CPU tensor.

        Not a negated view (its memory holds the values un-negated) nor a ``torch.func`` wrapper.
        """
        return (
            type(tensor) is Tensor
            and tensor.dtype is _FLOAT32
            and tensor.is_cpu
            and tensor.layout is _STRIDED
            and tensor.is_contiguous()
            and not tensor.is_neg()
            and tensor.numel() > 0
            and not in_torch_func(tensor)
        )

    @classmethod
    def takes(cls, tensor: Tensor) -> bool:
        """Whether ``tensor`` goes to the kernel as it is, here and now: :meth:`eager` and :meth:`readable`."""
        return cls.eager() and cls.readable(tensor)

    def accumulate_(self, index: int, values: Tensor, calls: float) -> None:
        """Add ``values``' statistics, and ``calls``, to row ``index``; ``values`` as :meth:`takes` accepts."""
        readable = values.detach() if values.requires_grad else values
        cstats.accumulate_f32(readable.numpy(), self.rows[index], self.table, self.right, self.fine, calls,
                              torch.get_num_threads())


_FLOAT32, _STRIDED = torch.float32, torch.strided


def native_table(inner: Tensor, right: Tensor) -> tuple[Tensor, bool]:
    """The C kernel's bin table for float32 bins, and whether one comparison per value suffices.

    Per cell of float32s sharing their top 13 bits (sign, exponent, four mantissa bits: 1/16
    octave): the cell's lowest bin and that bin's right edge. Where no cell holds more than one
    edge, one comparison with that edge gives the bin.

    Args:
        inner: The bins' inner edges, float32.
        right: Each bin's right edge, float32 (``inf`` for the last).
    """
    keys = torch.arange(1 << 13, dtype=torch.int32) << 19
    ends = torch.stack([keys, keys | ((1 << 19) - 1)]).view(torch.float32)  # the cell's two ends
    ends = torch.where(ends.isfinite(), ends, 0.0)  # Inf/NaN cells are never looked up
    first, last = torch.bucketize(ends, inner).to(torch.int32)
    lowest = torch.minimum(first, last)
    edge = right[lowest.long()]
    table = torch.stack([lowest, edge.view(torch.int32)], 1).contiguous()
    return table, bool(((first - last).abs() <= 1).all())
