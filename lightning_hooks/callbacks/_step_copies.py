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

A copy kept as a spare may also be *chained*: its last reader, alone with it after the step,
overwrote it with the parameters as the step left them (``chain_squares_``: the update's norm
and that copy in one pass, on the CPU) and said so (:meth:`~StepCopies.chain`). The next
:meth:`~StepCopies.hold` then copies nothing for a parameter that has not changed since: one whose
version counter (``param._version``, raised by every in-place op on it or a view, under
``no_grad`` too: a rollback's ``copy_``, ``load_state_dict``, another callback's rewrite) and
storage (``data_ptr``, held alive by the record so no other tensor can take its address: a
``p.data = x``) are those the chain saw. A parameter written through ``p.data`` in place
(``p.data.clamp_()``; ``.data`` is a tensor with a version counter of its own), through a numpy
view or its storage, is not seen: ``LIGHTNING_HOOKS_NATIVE=0`` turns chaining off with the C
passes. Only plain, unsplit parameters are chained (not DTensors, nor FSDP1's flat shards).

The step post-hooks run in the order they were put on: a reader that must see the update
UpdateTransform made puts its post-hook on after ``on_fit_start`` (UpdateTransform's).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_hooks.measure import _update_passes as update_passes
from lightning_hooks.measure._sharding import SHARD_GROUP_ATTRIBUTE, local

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
    parts = [local(param).detach() for param in params]
    fits = [spare is not None and spare.shape == part.shape and spare.dtype == part.dtype
            and spare.device == part.device and spare.stride() == part.stride() for spare, part in zip(spares, parts)]
    copies = [spare if fit and spare is not None else torch.empty_like(part)
              for spare, part, fit in zip(spares, parts, fits)]
    return copies, update_passes.copy_squares_(copies, parts, squares)


class _Chained(NamedTuple):
    """A spare that holds its parameter as it was when :meth:`StepCopies.chain` was told."""

    param: Tensor
    storage: Tensor  # a view of the parameter's memory then: keeps its address from being taken by another tensor
    version: int
    sums: Tensor  # the squares of the copy, summed as it was written: ``sums[index]``
    index: int

    def holds(self, param: Tensor) -> bool:
        """Whether ``param`` has not changed since (same object, no in-place op, same memory)."""
        return (param is self.param and param._version == self.version
                and param.data_ptr() == self.storage.data_ptr() and param.shape == self.storage.shape)


_PLAIN = (torch.nn.Parameter, Tensor)  # a DTensor parameter is of type DTensor; FSDP1's FlatParameter a subclass


def _chainable(param: Tensor) -> bool:
    """Whether a copy of ``param`` may be chained: a plain tensor, whole on this rank (FSDP1 splits none of it)."""
    return type(param) in _PLAIN and not hasattr(param, SHARD_GROUP_ATTRIBUTE)


class StepCopies:
    """The parameters of one optimizer as they were before its step, one copy each, held by readers."""

    def __init__(self) -> None:
        self._copies: dict[int, Tensor] = {}  # by id of parameter
        self._holders: dict[int, set[Hashable]] = {}  # by id of parameter: who holds its copy
        self._held: dict[Hashable, list[Tensor]] = {}  # by holder: its parameters, in its order
        self._spares: dict[int, Tensor] = {}  # by id of parameter: a released copy's memory, for the next hold
        self._keepers: set[Hashable] = set()  # the holders whose next step holds again
        self._squares: dict[int, tuple[Tensor, int]] = {}  # by id of parameter: (sums, index) of its copy's squares
        self._chained: dict[int, _Chained] = {}  # by id of parameter: a spare that holds it as it is (see chain)

    @torch.no_grad()
    def hold(self, holder: Hashable, params: Sequence[Tensor], squares: bool = False) -> None:
        """Keep ``params`` as they are now for ``holder`` until it releases them (copying those not yet held).

        A holder holds one step at a time: what it held before is released first. A copy is made
        into a spare's memory where one is kept for that parameter.

        Args:
            holder: The reader.
            params: The parameters it reads.
            squares: It reads their copies' sums of squares (:meth:`squares`): summed as they
                are copied (in the same read on the CPU), or from a copy another holder made.
        """
        self.release(holder, keep=holder in self._keepers)
        missing = {id(param): param for param in params if id(param) not in self._copies}
        if self._chained:
            self._take_chained(missing)
        made, sums = copies_of(list(missing.values()), [self._spares.pop(key, None) for key in missing], squares)
        self._copies.update(zip(missing, made))
        if sums is not None:
            self._squares.update((key, (sums, i)) for i, key in enumerate(missing))
        for param in params:
            self._holders.setdefault(id(param), set()).add(holder)
        self._held[holder] = list(params)
        unsummed = [id(param) for param in params if id(param) not in self._squares]
        if squares and unsummed:
            sums = update_passes.squares([self._copies[key] for key in unsummed])
            self._squares.update((key, (sums, i)) for i, key in enumerate(unsummed))

    def _take_chained(self, missing: dict[int, Tensor]) -> None:
        """Hold the chained spares of ``missing``'s unchanged parameters as they are (taken out of ``missing``)."""
        for key, param in list(missing.items()):
            chained = self._chained.pop(key, None)
            if chained is not None and chained.holds(param):
                self._copies[key] = self._spares.pop(key)
                self._squares[key] = chained.sums, chained.index
                del missing[key]

    def chain(self, params: Sequence[Tensor], copies: Sequence[Tensor], sums: Tensor,
              views: Sequence[Tensor]) -> None:
        """Say that each of ``copies``, a spare now, was just overwritten with its parameter as it is.

        Called by the last reader of a step's copies after the step, alone with them, once it has
        written each parameter into its copy (``sums``: each one's squares, as the copy summed
        them). The next :meth:`hold` of a parameter that has not changed since copies nothing.
        A copy that is not its parameter's spare, or whose parameter cannot be chained (a
        DTensor, FSDP1's flat shards), is left as any spare.

        Args:
            params: The parameters.
            copies: Their copies, each now holding its parameter's values.
            sums: Each copy's sum of squares (float64), in this order.
            views: A detached view of each parameter (``param.detach()``), kept with the record:
                its memory stays allocated, so no other tensor can take its address.
        """
        for i, (param, copy) in enumerate(zip(params, copies)):
            if self._spares.get(id(param)) is copy and _chainable(param):
                self._chained[id(param)] = _Chained(param, views[i], param._version, sums, i)

    def update_squares(self, params: Sequence[Tensor], after: Sequence[Tensor], before: Sequence[Tensor],
                       alone: bool, chain: bool) -> Tensor:
        """Each parameter's ``||w_after - w_before||²`` (float64), its copies chained where asked and safe.

        Args:
            params: The parameters, as held.
            after: A detached view of each (``w_after``, this rank's part).
            before: Their copies (``w_before``), spares now.
            alone: The copies are the caller's alone: they may be overwritten (with the update,
                or with ``w_after``).
            chain: The next step holds these parameters again: with ``alone``, on the CPU the
                update's norm is taken in the pass that leaves ``w_after`` in the copies, and
                :meth:`chain` is told. Not for a parameter given twice (one copy, written twice).
        """
        if chain and alone and len({id(p) for p in params}) == len(params):
            chained = update_passes.chain_squares_(after, before)  # None where the C passes cannot take them all
            if chained is not None:
                self.chain(params, before, chained[1], after)
                return chained[0]
        return update_passes.update_squares(after, before, in_place=alone)

    def holds(self, holder: Hashable) -> bool:
        """Whether ``holder`` holds copies now."""
        return holder in self._held

    def copies(self, holder: Hashable) -> list[Tensor]:
        """``holder``'s copies, in the order it gave the parameters."""
        return [self._copies[id(param)] for param in self._held[holder]]

    def squares(self, holder: Hashable) -> Tensor:
        """The sum of squares of each of ``holder``'s copies as they were made (float64), in its order.

        Only for a holder that asked for them (``hold(..., squares=True)``).
        """
        found = [self._squares[id(param)] for param in self._held[holder]]
        sums = found[0][0] if found else None
        if sums is not None and len(sums) == len(found) and all(s is sums and i == j for j, (s, i) in enumerate(found)):
            return sums  # the common case: one hold copied them all, in this order
        return torch.stack([s[i] for s, i in found]) if found else torch.zeros(0, dtype=torch.float64)

    def exclusive(self, holder: Hashable) -> bool:
        """Whether no other holder holds any of ``holder``'s copies (then it may change them in place)."""
        return all(self._holders[id(param)] == {holder} for param in self._held.get(holder, ()))

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
        for key in {id(param) for param in self._held.pop(holder, ())}:  # once each: a tied one may be held twice
            holders = self._holders[key]
            holders.discard(holder)
            if not holders:
                del self._holders[key]
                copy = self._copies.pop(key)
                self._squares.pop(key, None)  # a copy changed in place by its last reader: no longer its sum
                if self._keepers:
                    self._spares[key] = copy
        if not self._keepers:
            self._spares.clear()
            self._chained.clear()

    @property
    def numel(self) -> int:
        """How many elements are copied now, over every holder."""
        return sum(copy.numel() for copy in self._copies.values())

    @property
    def spare_numel(self) -> int:
        """How many elements of released copies are kept for the next hold."""
        return sum(spare.numel() for spare in self._spares.values())
