"""Step copies kept from one step to the next: which copies hold their parameters as a step left them, and how to tell.

A copy kept as a spare (see :class:`~lightning_hooks.callbacks._step_copies.StepCopies`) may also
be *chained*: its last reader, alone with it after the step, measured the update in the C pass that
also overwrote the copy with the parameters as the step left them (``StepCopies.update_squares``).
The next hold then copies nothing for a parameter that has not changed since: the same object,
whose version counter (``param._version``, raised by every in-place op on it or a view, under
``no_grad`` too: a rollback's ``copy_``, ``load_state_dict``, another callback's rewrite), address
(``data_ptr``, its memory held alive by the record so no other tensor can take it: a ``p.data = x``)
and shape are those the pass saw. A parameter written through ``p.data`` in place
(``p.data.clamp_()``; ``.data`` is a tensor with a version counter of its own), through a numpy view
or its storage, is not seen: ``LIGHTNING_HOOKS_NATIVE=0`` turns chaining off with the C passes. Only
plain, unsplit parameters are chained (not DTensors, nor FSDP1's flat shards), and only when every
parameter the reader measures is one, each given once.

Many small parameters: a reader holding the same parameters at every step (the record of the last
chained pass, :class:`Chain`, kept from step to step by :class:`Chains`) costs list operations done
in C, not Python work per parameter: the checks compare lists of ids, version counters, addresses
and shapes, and the C pass's views of the tensors are made once.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat
from typing import Optional

import torch
from torch import Tensor

from lightning_hooks.measure._chain_plan import ChainPlan
from lightning_hooks.measure._sharding import SHARD_GROUP_ATTRIBUTE

_PLAIN = (torch.nn.Parameter, Tensor)  # a DTensor parameter is of type DTensor; FSDP1's FlatParameter a subclass


def chainable(param: Tensor) -> bool:
    """Whether a copy of ``param`` may be chained: a plain tensor, whole on this rank (FSDP1 splits none of it)."""
    return type(param) in _PLAIN and not hasattr(param, SHARD_GROUP_ATTRIBUTE)


class Chain:
    """Copies that a chained pass left holding their parameters as they were after a step, and that pass's plan.

    Kept with the parameters' version counters, addresses and shapes then, to know at the next
    hold whether a parameter changed since; the plan's views of the parameters keep their memory
    allocated, so no other tensor can take an address. The same record serves every step while
    the same parameters are chained into the same copies: the plan's views are made once.
    """

    __slots__ = ("params", "keys", "copies", "plan", "ptrs", "shapes", "versions", "sums")

    def __init__(self, params: list[Tensor], keys: list[int], copies: list[Tensor], plan: ChainPlan,
                 ptrs: list[int]) -> None:
        self.params, self.keys, self.copies, self.plan, self.ptrs = params, keys, copies, plan, ptrs
        self.shapes = [p.shape for p in params]
        self.versions: list[int] = []
        self.sums = torch.zeros(0, dtype=torch.float64)

    def unchanged(self) -> bool:
        """Whether no parameter changed since the pass: no in-place op (its version), the same memory and shape."""
        params = self.params
        return ([p._version for p in params] == self.versions and [p.data_ptr() for p in params] == self.ptrs
                and [p.shape for p in params] == self.shapes)

    def holds(self, i: int, param: Tensor) -> bool:
        """Whether copy ``i`` holds ``param`` as it is (the check of :meth:`unchanged`, for one)."""
        return (param is self.params[i] and param._version == self.versions[i] and param.data_ptr() == self.ptrs[i]
                and param.shape == self.shapes[i])

    def runs_on(self, keys: list[int], before: Sequence[Tensor], params: Sequence[Tensor]) -> bool:
        """Whether the plan measures these parameters into these copies, the parameters' memory unchanged."""
        return (keys == self.keys and all(map(operator.is_, before, self.copies))
                and [p.data_ptr() for p in params] == self.ptrs)

    def copies_into(self, keys: list[int], spares: dict[int, Tensor], params: Sequence[Tensor]) -> bool:
        """Whether the plan copies these parameters into their ``spares``: the same tensors, memory and shapes."""
        return (keys == self.keys and all(map(operator.is_, map(spares.get, keys), self.copies))
                and [p.data_ptr() for p in params] == self.ptrs and [p.shape for p in params] == self.shapes)

    def part(self, indices: list[int]) -> Chain:
        """The record of the copies at ``indices`` only (the others were taken)."""
        plan = ChainPlan([self.plan.after[i] for i in indices], [self.plan.before[i] for i in indices])
        part = Chain([self.params[i] for i in indices], [self.keys[i] for i in indices],
                      [self.copies[i] for i in indices], plan, [self.ptrs[i] for i in indices])
        part.versions, part.sums = [self.versions[i] for i in indices], self.sums[indices]
        part.shapes = [self.shapes[i] for i in indices]  # as the pass saw them, not as the parameters are now
        return part


class Chains:
    """The chained copies an optimizer's :class:`~lightning_hooks.callbacks._step_copies.StepCopies` keeps.

    ``kept``: the records whose copies hold their parameters as the last measured step left them,
    for the next hold; ``last``: the last chained pass's record, whose plan (its views made once)
    serves the next pass over the same tensors, chained or not.
    """

    def __init__(self) -> None:
        self.kept: list[Chain] = []
        self.last: Optional[Chain] = None

    def clear(self) -> None:
        """Forget every record (no holder's next step holds: the spares are freed)."""
        self.kept.clear()
        self.last = None

    @property
    def numel(self) -> int:
        """How many elements the kept copies hold."""
        return sum(copy.numel() for record in self.kept for copy in record.copies)

    def take(self, missing: dict[int, Tensor], copies: dict[int, Tensor], squares: dict[int, tuple[Tensor, int]],
             spares: dict[int, Tensor]) -> Optional[Tensor]:
        """Move the kept copies of ``missing``'s unchanged parameters into ``copies`` (taken out of ``missing``).

        Their squares go into ``squares``; a changed parameter's copy goes back to ``spares``, to
        be copied into. Returns the squares of the copies when one record held them all, in
        ``missing``'s order.
        """
        keys = list(missing)
        for record in self.kept:
            if record.keys == keys and record.unchanged():  # the common case: at C speed
                self.kept.remove(record)
                copies.update(zip(keys, record.copies))
                squares.update(zip(keys, zip(repeat(record.sums), range(len(keys)))))
                missing.clear()
                return record.sums
        for record in list(self.kept):
            left = []
            for i, key in enumerate(record.keys):
                param = missing.pop(key, None)
                if param is None:
                    left.append(i)
                elif record.holds(i, param):
                    copies[key], squares[key] = record.copies[i], (record.sums, i)
                else:
                    missing[key] = param  # changed: copied again, into this memory
                    spares[key] = record.copies[i]
            if len(left) < len(record.keys):
                self.kept.remove(record)
                if left:
                    self.kept.append(record.part(left))
        return None

    def planned_copy(self, params: Sequence[Tensor], keys: list[int],
                     spares: dict[int, Tensor]) -> Optional[tuple[list[Tensor], Tensor]]:
        """Copy ``params`` into their ``spares`` through the last plan's views (made once), where it is theirs.

        Steps measured one after another without a chain (another reader holds the copies too,
        or every parameter changed in between) copy the same parameters into the same spares.
        Returns the copies (taken out of ``spares``) and their squares; None (nothing taken)
        where the plan does not fit.
        """
        last = self.last
        sums = last.plan.copy_squares() if last is not None and last.copies_into(keys, spares, params) else None
        if last is None or sums is None:
            return None
        for key in keys:
            del spares[key]
        return list(last.copies), sums

    def plan(self, params: Sequence[Tensor], keys: list[int], before: Sequence[Tensor]) -> Optional[Chain]:
        """The record whose plan chains ``params`` into ``before``: the last one where it fits, else a new one."""
        last = self.last
        if last is not None and last.runs_on(keys, before, params):
            return last
        if (not params or not params[0].is_cpu or not ChainPlan.usable() or len(set(keys)) < len(keys)
                or not all(map(chainable, params))):
            return None  # no C pass (checked before any view), a parameter given twice (one copy, two writes), sharded
        plan = ChainPlan.of(params, before)
        if plan is None:
            return None
        self.last = Chain(list(params), keys, list(before), plan, [p.data_ptr() for p in params])
        return self.last

    def keep(self, record: Chain, sums: Tensor, versions: list[int], spares: dict[int, Tensor]) -> None:
        """Keep ``record``'s copies, each now holding its parameter, for the next hold (when they are ``spares``).

        ``versions``: the parameters' version counters as the pass saw them.
        """
        if not all(map(operator.is_, map(spares.get, record.keys), record.copies)):
            return  # not kept (no holder's next step holds), or another reader's too
        for key in record.keys:
            del spares[key]
        record.versions, record.sums = versions, sums
        if not any(r is record for r in self.kept):
            self.kept.append(record)
