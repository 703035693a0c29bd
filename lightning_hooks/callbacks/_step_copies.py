"""One copy of the parameters per optimizer step, shared by every reader of ``w_before``.

UpdateTransform (to rewrite the update), GradientMonitor's update ratios and norms (to measure
it), and whatever measures the update next (a spike signal, the flight record) each need the
parameters as they were just before the optimizer steps. Each asks the optimizer's
:class:`StepCopies` to :meth:`~StepCopies.hold` the parameters it reads, at any time before
the step (a step pre-hook, or ``on_before_optimizer_step``: the parameters do not move in
between); a parameter already copied for this step is not copied again. After the step each
reads its :meth:`~StepCopies.copies` and lets go (:meth:`~StepCopies.release`); a copy lives
until its last reader lets go. A reader may change its copies in place only when
:meth:`~StepCopies.exclusive` says nobody else holds them (UpdateTransform rewrites the update
in its copy when alone, in the parameters when not).

The step post-hooks run in the order they were put on: a reader that must see the update
UpdateTransform made puts its post-hook on after ``on_fit_start`` (UpdateTransform's).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_hooks.measure._sharding import local

_BY_OPTIMIZER: weakref.WeakKeyDictionary[Any, StepCopies] = weakref.WeakKeyDictionary()


def step_copies(optimizer: Any) -> StepCopies:
    """The snapshot of ``optimizer``'s steps (made at the first call, gone with the optimizer)."""
    found = _BY_OPTIMIZER.get(optimizer)
    if found is None:
        found = _BY_OPTIMIZER[optimizer] = StepCopies()
    return found


def copy_of(param: Tensor) -> Tensor:
    """This rank's part of ``param`` (its shard, when sharded), copied on its device."""
    return local(param).detach().clone()


class StepCopies:
    """The parameters of one optimizer as they were before its step, one copy each, held by readers."""

    def __init__(self) -> None:
        self._copies: dict[int, Tensor] = {}  # by id of parameter
        self._holders: dict[int, set[Hashable]] = {}  # by id of parameter: who holds its copy
        self._held: dict[Hashable, list[Tensor]] = {}  # by holder: its parameters, in its order

    @torch.no_grad()
    def hold(self, holder: Hashable, params: Sequence[Tensor]) -> None:
        """Keep ``params`` as they are now for ``holder`` until it releases them (copying those not yet held).

        A holder holds one step at a time: what it held before is released first.
        """
        self.release(holder)
        for param in params:
            key = id(param)
            if key not in self._copies:
                self._copies[key] = copy_of(param)
            self._holders.setdefault(key, set()).add(holder)
        self._held[holder] = list(params)

    def holds(self, holder: Hashable) -> bool:
        """Whether ``holder`` holds copies now."""
        return holder in self._held

    def copies(self, holder: Hashable) -> list[Tensor]:
        """``holder``'s copies, in the order it gave the parameters."""
        return [self._copies[id(param)] for param in self._held[holder]]

    def exclusive(self, holder: Hashable) -> bool:
        """Whether no other holder holds any of ``holder``'s copies (then it may change them in place)."""
        return all(self._holders[id(param)] == {holder} for param in self._held.get(holder, ()))

    def release(self, holder: Hashable) -> None:
        """Let go of ``holder``'s copies; a copy nobody holds any more is dropped."""
        for param in self._held.pop(holder, ()):
            holders = self._holders[id(param)]
            holders.discard(holder)
            if not holders:
                del self._holders[id(param)], self._copies[id(param)]

    @property
    def numel(self) -> int:
        """How many elements are copied now, over every holder."""
        return sum(copy.numel() for copy in self._copies.values())
