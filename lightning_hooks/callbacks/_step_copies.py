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

A copy's memory outlives the step only when some holder says its next step holds again
(``release(holder, keep=True)``: UpdateTransform and the update-norm signal hold every step,
GradientMonitor when its next step is measured): a copy nobody holds any more is then kept as a
spare, and the next :meth:`~StepCopies.hold` copies into it (memory already mapped: a fresh CPU
allocation faults in every page, 16 ms against 3.5 ms for 8 x ``Linear(1024, 1024)``). Once no
holder keeps (each released with ``keep=False``: a step nobody measures comes, or the fit ends),
the spares are freed, so the steps between a sparse logger's hold no copy.

A copy kept as a spare may also be *chained* (``_step_chain.py``): after a measured step, one C
pass writes ``w_after`` into the copies, and the next hold copies nothing for a parameter that has
not changed since.

The step post-hooks run in the order they were put on: a reader that must see the update
UpdateTransform made puts its post-hook on after ``on_fit_start`` (UpdateTransform's).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hooks.callbacks._step_chain import Chains
from lightning_hooks.measure import _update_passes as update_passes
from lightning_hooks.measure._sharding import local

_BY_OPTIMIZER: weakref.WeakKeyDictionary[Any, StepCopies] = weakref.WeakKeyDictionary()


def step_copies(optimizer: Any) -> StepCopies:
    """The snapshot of ``optimizer``'s steps (made at the first call, gone with the optimizer)."""
    found = _BY_OPTIMIZER.get(optimizer)
    if found is None:
        found = _BY_OPTIMIZER[optimizer] = StepCopies()
    return found


def copies_of(params: Sequence[Tensor], spares: Sequence[Optional[Tensor]],
              squares: bool = False) -> tuple[list[Tensor], Optional[Tensor]]:
    """This rank's part of each of ``params`` (its shard, when sharded), copied on its device, and their squares.

    Into its spare where one of the same shape, dtype and device is given, else into a fresh
    tensor of the same strides. Where the C passes read every part (CPU tensors), the copy also
    sums each part's squares in the same read, at no cost; elsewhere the squares are summed
    only when asked (``squares``: a norm pass). Returns the copies and the sums (float64, one per
    parameter) or None.
    """
    parts = list(map(local, params))  # not detached: the C passes' views detach (the tensor ops need not)
    fits = [spare is not None and spare.shape == part.shape and spare.dtype == part.dtype
            and spare.device == part.device and spare.stride() == part.stride() for spare, part in zip(spares, parts)]
    copies = [spare if fit and spare is not None else torch.empty_like(part)
              for spare, part, fit in zip(spares, parts, fits)]
    return copies, update_passes.copy_squares_(copies, parts, squares)


@dataclass
class _Held:
    """What one holder holds: its parameters in its order, their ids, and their copies' squares if in one tensor."""

    params: list[Tensor]  # kept alive while held: their ids key the copies
    keys: list[int]
    keyset: set[int]
    sums: Optional[Tensor]  # the squares of its copies in its order, where one hold found them together


class StepCopies:
    """The parameters of one optimizer as they were before its step, one copy each, held by readers.

    The common case, one reader holding the same parameters at every step, costs no Python work
    per parameter beyond list operations done in C (ids, version counters, addresses compared as
    lists); sharing between readers, and a parameter changed between steps, take the general path.
    """

    def __init__(self) -> None:
        self._copies: dict[int, Tensor] = {}  # by id of parameter
        self._held: dict[Hashable, _Held] = {}  # by holder
        self._spares: dict[int, Tensor] = {}  # by id of parameter: a released copy's memory, for the next hold
        self._keepers: set[Hashable] = set()  # the holders whose next step holds again
        self._squares: dict[int, tuple[Tensor, int]] = {}  # by id of parameter: (sums, index) of its copy's squares
        self._chains = Chains()  # spares holding their parameters as they are (see update_squares), the last plan

    @torch.no_grad()
    def hold(self, holder: Hashable, params: Sequence[Tensor], squares: bool = False) -> None:
        """Keep ``params`` as they are now for ``holder`` until it releases them (copying those not yet held).

        A holder holds one step at a time: what it held before is released first. A copy is made
        into a spare's memory where one is kept for that parameter, and none where a chained
        spare holds its parameter unchanged.

        Args:
            holder: The reader.
            params: The parameters it reads.
            squares: It reads their copies' sums of squares (:meth:`squares`): summed as they
                are copied (in the same read on the CPU), or from a copy another holder made.
        """
        self.release(holder, keep=holder in self._keepers)
        keys = list(map(id, params))
        copies = self._copies
        missing = {k: p for k, p in zip(keys, params) if k not in copies} if copies else dict(zip(keys, params))
        whole = len(missing) == len(keys)  # every one missing, each once: a tensor of sums may be in its order
        sums = self._chains.take(missing, copies, self._squares, self._spares) if self._chains.kept else None
        if missing:
            whole = whole and list(missing) == keys  # (a changed chained copy puts its key back: in its order)
            planned = self._chains.planned_copy(params, keys, self._spares) if whole and squares else None
            if planned is not None:
                made, sums = planned
            else:
                made, sums = copies_of(list(missing.values()), [self._spares.pop(key, None) for key in missing],
                                       squares)
            copies.update(zip(missing, made))
            if sums is not None:
                self._squares.update(zip(missing, zip(repeat(sums), range(len(missing)))))
        self._held[holder] = _Held(list(params), keys, set(keys), sums if whole else None)
        if squares and (sums is None or not whole):
            unsummed = [key for key in keys if key not in self._squares]
            if unsummed:
                found = update_passes.squares([copies[key] for key in unsummed])
                self._squares.update(zip(unsummed, zip(repeat(found), range(len(unsummed)))))

    def update_squares(self, params: Sequence[Tensor], before: Sequence[Tensor], alone: bool, chain: bool) -> Tensor:
        """Each parameter's ``||w_after - w_before||²`` (float64), its copies chained where asked and safe.

        Chained: on the CPU, one pass sums the update's squares and writes ``w_after`` into the
        copies, summing its squares; the next :meth:`hold` of a parameter that has not changed
        since (the same object, version counter, address and shape) copies nothing. Only when
        every parameter is plain and whole on this rank (not a DTensor, nor FSDP1's flat shards),
        each given once, and the copies are spares nobody else holds.

        Args:
            params: The parameters, as held (``w_after`` now).
            before: Their copies (``w_before``), spares now.
            alone: The copies are the caller's alone: they may be overwritten (with the update,
                or with ``w_after``).
            chain: The next step holds these parameters again: with ``alone``, chain the copies.
        """
        keys = list(map(id, params))
        record = self._chains.plan(params, keys, before)
        if record is not None and chain and alone:
            versions = [p._version for p in params]  # read here, while the plan's check left them in cache
            found = record.plan.run()
            if found is not None:
                self._chains.keep(record, found[1], versions, self._spares)
                return found[0]
        elif record is not None:  # not chained: the same views, for the next hold's copy too
            deltas = record.plan.diff_squares()
            if deltas is not None:
                return deltas
        return update_passes.update_squares(list(map(local, params)), before, in_place=alone)

    def holds(self, holder: Hashable) -> bool:
        """Whether ``holder`` holds copies now."""
        return holder in self._held

    def copies(self, holder: Hashable) -> list[Tensor]:
        """``holder``'s copies, in the order it gave the parameters."""
        return list(map(self._copies.__getitem__, self._held[holder].keys))

    def squares(self, holder: Hashable) -> Tensor:
        """The sum of squares of each of ``holder``'s copies as they were made (float64), in its order.

        Only for a holder that asked for them (``hold(..., squares=True)``).
        """
        held = self._held[holder]
        if held.sums is not None:
            return held.sums  # the common case: one hold found them all, in this order
        found = [self._squares[key] for key in held.keys]
        sums = found[0][0] if found else None
        if sums is not None and len(sums) == len(found) and all(s is sums and i == j for j, (s, i) in enumerate(found)):
            return sums
        return torch.stack([s[i] for s, i in found]) if found else torch.zeros(0, dtype=torch.float64)

    def exclusive(self, holder: Hashable) -> bool:
        """Whether no other holder holds any of ``holder``'s copies (then it may change them in place)."""
        held = self._held.get(holder)
        if held is None or len(self._held) == 1:
            return True
        return all(held.keyset.isdisjoint(other.keyset) for other in self._held.values() if other is not held)

    def release(self, holder: Hashable, keep: bool = False) -> None:
        """Let go of ``holder``'s copies (if it holds any) and say whether its next step holds again.

        Args:
            holder: The reader letting go.
            keep: Its next step holds again: a copy nobody holds any more is kept as a spare for
                that hold to copy into. With ``False``, once no holder keeps, every spare is freed.
        """
        if keep:
            self._keepers.add(holder)
        else:
            self._keepers.discard(holder)
        held = self._held.pop(holder, None)
        if held is not None:
            freed = held.keyset.difference(*(other.keyset for other in self._held.values()))
            if len(freed) == len(self._copies):  # nobody holds any copy now (one holder: the common case)
                gone, self._copies, self._squares = self._copies, {}, {}
            else:  # a copy changed in place by its last reader no longer has its sum: dropped with it
                gone = {key: self._copies.pop(key) for key in freed}
                for key in freed:
                    self._squares.pop(key, None)
            if self._keepers:
                self._spares.update(gone)
        if not self._keepers:
            self._spares.clear()
            self._chains.clear()

    @property
    def numel(self) -> int:
        """How many elements are copied now, over every holder."""
        return sum(copy.numel() for copy in self._copies.values())

    @property
    def spare_numel(self) -> int:
        """How many elements of released copies are kept for the next hold (chained ones included)."""
        return sum(spare.numel() for spare in self._spares.values()) + self._chains.numel
