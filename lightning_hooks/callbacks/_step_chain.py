"""A chained step copy's record: which copies hold their parameters as a step left them, and how to tell.

See :class:`~lightning_hooks.callbacks._step_copies.StepCopies` (``update_squares``): after a
measured step, one C pass writes ``w_after`` into the copies, and the next step holds them without
a copy for each parameter that has not changed since.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_hooks.measure import _update_passes as update_passes
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

    def __init__(self, params: list[Tensor], keys: list[int], copies: list[Tensor], plan: update_passes.ChainPlan,
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
        plan = update_passes.ChainPlan([self.plan.after[i] for i in indices], [self.plan.before[i] for i in indices])
        part = Chain([self.params[i] for i in indices], [self.keys[i] for i in indices],
                      [self.copies[i] for i in indices], plan, [self.ptrs[i] for i in indices])
        part.versions, part.sums = [self.versions[i] for i in indices], self.sums[indices]
        part.shapes = [self.shapes[i] for i in indices]  # as the pass saw them, not as the parameters are now
        return part
