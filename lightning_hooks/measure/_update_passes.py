"""The update ratio's passes over parameters: a copy that also sums the squares it moves, and ``sum((a - b)²)``.

And, on the CPU only, the two at once: ``sum((a - b)²)`` that also moves ``a`` into ``b`` and sums
its squares (:class:`~lightning_hooks.measure._chain_plan.ChainPlan`, through this module's
:func:`numpy_view`), so that a step measured right after another needs no copy.

On the CPU the C passes of ``_cupdate.c`` run (float64 sums; the copy and its norm in one read,
the update's norm without storing the update); elsewhere, or where a tensor is not a plain
contiguous float32/float64/float16/bfloat16 CPU tensor, or while ``torch.compile`` traces or a
torch mode is on, the multi-tensor ops do the same (norms in float32, float64 for float64
tensors, squared in float64). Set ``LIGHTNING_HOOKS_NATIVE=0`` to use the tensor ops everywhere. Every function
returns a 1-D float64 tensor, one sum of squares per tensor given, on the tensors' device.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from lightning_hooks.core._torch_internals import torch_modes_on

NATIVE_ABI = 3  # _cupdate.c's ABI_VERSION: a build left over from older sources is not used
try:  # built at install time where a C compiler is available
    from lightning_hooks.measure import _cupdate as cupdate  # type: ignore[attr-defined]

    if getattr(cupdate, "ABI_VERSION", None) != NATIVE_ABI:
        warnings.warn("lightning_hooks: the compiled update passes were built from older sources and are not used;"
                      " rebuild them with `pip install -e .`", stacklevel=2)
        cupdate = None
except ImportError:  # pragma: no cover - depends on the build
    cupdate = None

#: Whether CPU parameters go through the C passes (the same figures, in float64, in fewer passes).
NATIVE_PASSES: bool = cupdate is not None and os.environ.get("LIGHTNING_HOOKS_NATIVE", "1") != "0"

_SMALL = 1 << 14  # values: below this on average, a copy that needs no sums is one multi-tensor op
_BATCH = 1 << 24  # values: where the update is stored, at most this much more memory (or one tensor's size)
_FORMATS = {torch.float32: None, torch.float64: None, torch.float16: None, torch.bfloat16: torch.int16}


def small(tensors: Sequence[Tensor]) -> bool:
    """Whether ``tensors`` hold under ``_SMALL`` values on average (a copy of them without sums is one op).

    One ``_foreach_copy_`` of such tensors costs less than the C passes' numpy view of each
    (about 0.8 us a tensor).
    """
    return sum(t.numel() for t in tensors) < _SMALL * len(tensors)


def numpy_view(tensor: Tensor) -> object:
    """The numpy view of ``tensor``'s memory that the C passes read (bfloat16 as int16), detached where it must be.

    A parameter is detached here, where a view is made, not by every caller: the tensor ops
    read it as it is, and a plan's views are made once.

    Raises (KeyError, TypeError, RuntimeError) where there is none: another dtype, a tensor
    subclass (other than a parameter's) or off the CPU, a negated view.
    """
    if type(tensor) is not Tensor or tensor.requires_grad:
        tensor = _detached(tensor)
    as_int = _FORMATS[tensor.dtype]
    return (tensor if as_int is None else tensor.view(as_int)).numpy()


def _all_native(kernel: Callable[..., None], lists: Sequence[Sequence[Tensor]]) -> Optional[Tensor]:
    """The C pass ``kernel`` over every tensor of ``lists`` at once: one sum each; None where it cannot take them all.

    The hot path: no check per tensor beyond what making its view and the C code's own checks
    (contiguity, types, lengths, all read before any work) do; a list it refuses goes through
    :func:`_split`.
    """
    if not NATIVE_PASSES or torch.compiler.is_compiling() or torch_modes_on():
        return None
    try:
        views = [[numpy_view(t) for t in tensors] for tensors in lists]
        sums = torch.empty(len(lists[0]), dtype=torch.float64)
        kernel(*views, sums.numpy(), torch.get_num_threads())
    except (KeyError, TypeError, ValueError, RuntimeError):
        return None
    return sums


_NARROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # tensor_squares' order


def tensor_squares(tensors: Sequence[Tensor]) -> Optional[Tensor]:
    """Each tensor's sum of squares (float64, on the CPU), read by the C pass from the tensors themselves.

    The gradient check's read on the CPU: no numpy view per tensor, no tensor made per tensor.
    None (nothing computed) unless every tensor is a plain contiguous float32, float16 or bfloat16
    CPU tensor (not a parameter, not a subclass) and the C passes are on, outside tracing and torch
    modes. The squares of such values cannot overflow a float64 sum: an infinite or NaN sum means
    an Inf or a NaN in the tensor, and only then.
    """
    if not NATIVE_PASSES or not tensors or torch.compiler.is_compiling() or torch_modes_on():
        return None
    sums = np.empty(len(tensors))  # float64; a tensor made from it is no tensor operation (a `numpy()` is 3)
    if cupdate.tensor_squares(tensors, sums, torch.get_num_threads(), Tensor, _NARROW_DTYPES):
        return torch.from_numpy(sums)
    return None


def _detached(tensor: Tensor) -> Tensor:
    """``tensor.detach()`` (a parameter's is a plain tensor); TypeError where that is another subclass."""
    tensor = tensor.detach()
    if type(tensor) is not Tensor:
        raise TypeError(f"the C passes read plain tensors, got {type(tensor).__name__}")
    return tensor


def _plain(tensor: Tensor) -> Tensor:
    """``tensor`` as the C passes read it: detached where it requires grad or is a parameter (a subclass stays one)."""
    return tensor if type(tensor) is Tensor and not tensor.requires_grad else tensor.detach()


def _native(*tensors: Tensor) -> bool:
    """Whether the C passes read these :func:`_plain` tensors (same dtype and size) as their views show them."""
    first = tensors[0]
    return all(type(t) is Tensor and t.is_cpu and t.layout is torch.strided and t.dtype in _FORMATS
               and t.dtype is first.dtype and t.numel() == first.numel() and t.is_contiguous()
               and not t.is_neg() and not t.is_conj() for t in tensors)


def _none(*args: object) -> None:
    """No C pass (the extension is not built): never called, :data:`NATIVE_PASSES` is False then."""


def _split(pairs: Sequence[tuple[Tensor, ...]]) -> tuple[list[int], list[int], list[tuple[Tensor, ...]]]:
    """The indices the C passes take, the others, and the pairs :func:`_plain` (detached once, where checked).

    None native (and no pair detached) off the CPU, under tracing or a torch mode.
    """
    if not NATIVE_PASSES or not pairs or torch.compiler.is_compiling() or torch_modes_on():
        return [], list(range(len(pairs))), []
    if not all(t.is_cpu for pair in pairs for t in pair):
        return [], list(range(len(pairs))), []
    plain = [tuple(map(_plain, pair)) for pair in pairs]
    native = [i for i, pair in enumerate(plain) if _native(*pair)]
    taken = set(native)
    return native, [i for i in range(len(pairs)) if i not in taken], plain


def _squares_of_norms(tensors: list[Tensor]) -> Tensor:
    """Each tensor's squared norm: float32 norms (float64 for float64 tensors, which float32 cannot take), squared.

    No index goes to the device: a mixed list is put back in order by views.
    """
    wide = [t.dtype is torch.float64 for t in tensors]
    if not any(wide):
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).double().square()
    if all(wide):
        return torch.stack(torch._foreach_norm(tensors, 2)).square()
    groups = {kind: [i for i, w in enumerate(wide) if w is kind] for kind in (False, True)}
    norms: list[Tensor] = [tensors[0]] * len(tensors)
    for kind, where in groups.items():
        found = torch.stack(torch._foreach_norm([tensors[i] for i in where], 2, dtype=torch.float64 if kind
                                                else torch.float32)).double()
        for i, norm in zip(where, found.unbind()):
            norms[i] = norm
    return torch.stack(norms).square()


def _batches(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive ranges of tensors of at most ``_BATCH`` values each (or one tensor): the updates made at once."""
    ranges, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if total and total + size > _BATCH:
            ranges.append((start, i))
            start, total = i, 0
        total += size
    return [*ranges, (start, len(sizes))]


def _in_parts(kernel: Callable[..., None], lists: Sequence[Sequence[Tensor]],
              others: Callable[[list[int]], Tensor]) -> Tensor:
    """One sum per tensor: the C pass ``kernel`` over the tensors it reads as they are, ``others(rest)`` else."""
    native, rest, plain = _split(list(zip(*lists)))
    sums = torch.empty(len(native), dtype=torch.float64)
    if native:  # views of the tensors detached by the check: not detached again
        views = [[numpy_view(plain[i][k]) for i in native] for k in range(len(lists))]
        kernel(*views, sums.numpy(), torch.get_num_threads())
    rest_sums = others(rest) if rest else torch.zeros(0, dtype=torch.float64)
    return _gather(len(lists[0]), native, sums, rest, rest_sums)


def _gather(n: int, native: list[int], native_sums: Tensor, rest: list[int], rest_sums: Tensor) -> Tensor:
    if not rest:
        return native_sums
    if not native:
        return rest_sums
    out = torch.empty(n, dtype=torch.float64)
    out[native], out[rest] = native_sums, rest_sums.cpu()
    return out


@torch.no_grad()
def copy_squares_(copies: Sequence[Tensor], params: Sequence[Tensor], squares: bool = True) -> Optional[Tensor]:
    """Copy each of ``params`` into its copy (same shape and dtype) and give each one's sum of squares.

    With ``squares=False`` the sums come only where they are free (the C passes took every
    tensor, of ``_SMALL`` values or more on average), else None.
    """
    if not params:
        return torch.zeros(0, dtype=torch.float64)
    if not squares and small(params):
        torch._foreach_copy_(list(copies), list(params))  # small tensors: a numpy view each costs more than the copy
        return None
    found = _all_native(cupdate.copy_squares if cupdate is not None else _none, [copies, params])
    if found is not None:
        return found
    if not squares:
        torch._foreach_copy_(list(copies), list(params))
        return None

    def others(rest: list[int]) -> Tensor:
        torch._foreach_copy_([copies[i] for i in rest], [params[i] for i in rest])
        return _squares_of_norms([params[i] for i in rest])

    return _in_parts(cupdate.copy_squares if cupdate is not None else _none, [copies, params], others)


@torch.no_grad()
def squares(tensors: Sequence[Tensor]) -> Tensor:
    """Each tensor's sum of squares."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    found = _all_native(cupdate.squares if cupdate is not None else _none, [tensors])
    if found is not None:
        return found
    return _in_parts(cupdate.squares if cupdate is not None else _none, [tensors],
                     lambda rest: _squares_of_norms([tensors[i] for i in rest]))


@torch.no_grad()
def update_squares(after: Sequence[Tensor], before: Sequence[Tensor], in_place: bool = False) -> Tensor:
    """Each parameter's ``sum((after - before)²)``: the squared norm of its update.

    Args:
        after: The parameters after the step.
        before: Their copies before it.
        in_place: ``before`` may be overwritten (its reader's alone): where the tensor ops run,
            the update is made in it rather than in a new tensor. The C passes store no update.
    """
    if not after:
        return torch.zeros(0, dtype=torch.float64)
    found = _all_native(cupdate.diff_squares if cupdate is not None else _none, [after, before])
    if found is not None:
        return found

    def others(rest: list[int]) -> Tensor:
        olds, news = [before[i] for i in rest], [after[i] for i in rest]
        if in_place:
            torch._foreach_sub_(olds, news)  # w_before - w_after: the same norm
            return _squares_of_norms(olds)
        return torch.cat([_squares_of_norms(list(torch._foreach_sub(news[lo:hi], olds[lo:hi])))
                          for lo, hi in _batches([t.numel() for t in news])])

    return _in_parts(cupdate.diff_squares if cupdate is not None else _none, [after, before], others)
