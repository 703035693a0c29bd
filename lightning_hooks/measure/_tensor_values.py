"""Which values statistics are taken over: the tensors inside a module's output, as flat floats.

:func:`iter_tensors` finds every tensor in an output (tuples, lists, dicts, dataclasses, a
``PackedSequence``'s data); :func:`as_float_values` turns one into the flat float32 or float64
values the kernels of ``stats`` read, or skips it (sparse, quantized, meta, empty).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence


def iter_tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor inside a module's output, in order: tuples, lists, dicts, dataclasses; others skipped.

    A ``PackedSequence`` (what an RNN fed ``pack_padded_sequence`` returns) gives its ``data``
    alone: its ``batch_sizes`` and sort indices are bookkeeping, not values. Any depth of
    nesting is walked (with a stack, not recursion), and each container once: a list that holds
    itself gives its tensors once, not once per level.
    """
    if isinstance(value, Tensor):  # the usual output: no walk
        yield value
        return
    stack, seen = [value], set()
    while stack:
        value = stack.pop()
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, PackedSequence):
            yield value.data
        elif id(value) in seen:
            continue
        elif isinstance(value, (tuple, list, dict)) or (is_dataclass(value) and not isinstance(value, type)):
            seen.add(id(value))
            stack.extend(reversed(_items(value)))


def _items(container: Any) -> list[Any]:
    """A container's items, in order: a dict's values, a dataclass's fields."""
    if isinstance(container, dict):
        return list(container.values())
    if isinstance(container, (tuple, list)):
        return list(container)
    return [getattr(container, field.name, None) for field in fields(container)]


def as_float_values(tensor: Tensor) -> Tensor | None:
    """The flat floating values that stats are taken over, or None for a tensor we skip.

    float64 tensors keep float64 (a finite 1e300 stays finite); other floating, integer and
    bool tensors give float32; complex tensors their magnitude. Sparse, quantized, meta and
    empty tensors are skipped.
    """
    if tensor.dtype is _FLOAT32 and tensor.layout is _STRIDED:  # the usual case, in fewer calls (never quantized)
        return None if tensor.is_meta or tensor.numel() == 0 else tensor.detach().reshape(-1)
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta or tensor.numel() == 0:
        return None
    values = tensor.detach()
    if values.is_complex():
        values = values.abs()
    values = values.reshape(-1)
    if values.dtype in _ROUNDED and torch.compiler.is_compiling():
        return torch.ops.lightning_hooks.as_float32(values)
    return values if values.dtype == torch.float64 else values.float()


def as_stored(tensor: Tensor) -> Tensor:
    """``tensor`` with the values it holds, as float32 under ``torch.compile`` when it is bfloat16 or float16.

    Inductor fuses a module's computation with the hook that reads its output: a read of a bf16
    output in float32 (``.float()``, ``amax``) is then taken from the float32 value before it was
    rounded to bf16 (a GELU's max read as 2.6938 where the module's output holds 2.6875). The
    read goes through an opaque op instead, so the output is rounded and stored first, and the
    figures are those of the output, as in eager mode. Eager code gets ``tensor`` as it is.
    """
    if tensor.dtype in _ROUNDED and torch.compiler.is_compiling():
        return torch.ops.lightning_hooks.as_float32(tensor)
    return tensor


def _as_float32(tensor: Tensor) -> Tensor:
    return tensor.to(torch.float32, copy=True)


def _as_float32_fake(tensor: Tensor) -> Tensor:
    return torch.empty_like(tensor, dtype=torch.float32)


_FLOAT32, _STRIDED = torch.float32, torch.strided
_ROUNDED = (torch.bfloat16, torch.float16)

# An op of our own (not decomposed: inductor calls it as a kernel) that makes a float32 copy.
_LIBRARY = torch.library.Library("lightning_hooks", "FRAGMENT")
_LIBRARY.define("as_float32(Tensor tensor) -> Tensor")
_LIBRARY.impl("as_float32", _as_float32, "CompositeExplicitAutograd")
(getattr(torch.library, "register_fake", None) or torch.library.impl_abstract)(
    "lightning_hooks::as_float32", _as_float32_fake, lib=_LIBRARY)
