"""The chained C pass: ``sum((after - before)²)`` that also moves ``after`` into ``before`` and sums its squares.

On the CPU only (``_cupdate.c``'s ``chain_squares``), over lists of tensors fixed from step to step:
their numpy views (:func:`~lightning_hooks.measure._update_passes.numpy_view`) are made once, and
the pass runs at every step through them, so that a step measured right after another needs no
copy (``StepCopies.update_squares``). The passes over any tensors, with their fallbacks to the
tensor ops, are in ``_update_passes.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_hooks.core._torch_internals import torch_modes_on
from lightning_hooks.measure import _update_passes as passes


class ChainPlan:
    """The chained C pass over fixed lists of tensors, their views made once and the pass run at every step.

    A numpy view costs about 1 us a tensor, more than the pass itself on a small one: a step that
    measures the same parameters into the same copies as the step before reuses the plan (see
    ``StepCopies``). The views hold each tensor's memory as it was when the plan was made: a
    plan is run only while every tensor still has that memory (the caller checks its address).
    The same views serve a step that is not chained (the copy before it, the update's norm after
    it: :meth:`copy_squares`, :meth:`diff_squares`), where the same copies are held step after step.
    """

    __slots__ = ("after", "before", "count")

    def __init__(self, after: list[object], before: list[object]) -> None:
        self.after, self.before, self.count = after, before, len(after)

    @staticmethod
    def of(after: Sequence[Tensor], before: Sequence[Tensor]) -> Optional[ChainPlan]:
        """The plan over ``after`` and ``before`` (``before`` writable); None where the C passes cannot take them all.

        Only plain tensors (or parameters) on the CPU (their view, else a refusal: another dtype, a
        subclass); the C pass checks the rest (contiguity, types, lengths) as it runs.
        """
        if not after or not ChainPlan.usable():
            return None
        try:
            return ChainPlan([passes.numpy_view(t) for t in after], [passes.numpy_view(t) for t in before])
        except (KeyError, TypeError, RuntimeError):
            return None

    @staticmethod
    def usable() -> bool:
        """Whether the C passes run here and now: built, not turned off, no tracing, no torch mode on."""
        return (passes.cupdate is not None and passes.NATIVE_PASSES and not torch.compiler.is_compiling()
                and not torch_modes_on())

    def copy_squares(self) -> Optional[Tensor]:
        """``copy_squares_`` of ``after`` into ``before`` by the C pass, through the views; None where refused."""
        return self._sums("copy_squares", self.before, self.after)

    def diff_squares(self) -> Optional[Tensor]:
        """``update_squares`` of ``after`` against ``before`` by the C pass; None where refused."""
        return self._sums("diff_squares", self.after, self.before)

    def _sums(self, kernel: str, *views: list[object]) -> Optional[Tensor]:
        """The C pass named ``kernel`` over ``views``: one sum per pair; None where it cannot run or refuses."""
        if not ChainPlan.usable():
            return None
        sums = torch.empty(self.count, dtype=torch.float64)
        try:
            getattr(passes.cupdate, kernel)(*views, sums.numpy(), torch.get_num_threads())
        except (TypeError, ValueError):
            return None
        return sums

    def run(self) -> Optional[tuple[Tensor, Tensor]]:
        """Each pair's ``sum((after - before)²)`` and ``sum(after²)`` (float64), ``after`` moved into ``before``.

        None, with nothing read or written, where the C pass refuses a pair (not C-contiguous,
        another type or length) or cannot run now (:meth:`usable`).
        """
        if not ChainPlan.usable():
            return None
        sums = torch.empty(2 * self.count, dtype=torch.float64)
        try:
            passes.cupdate.chain_squares(self.after, self.before, sums.numpy(), torch.get_num_threads())
        except (TypeError, ValueError):
            return None
        return sums[:self.count], sums[self.count:]
