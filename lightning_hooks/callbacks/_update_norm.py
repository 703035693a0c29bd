"""The norm of every optimizer step's update ``||w_after - w_before||``, for ``SpikeTrigger(update_norm=...)``.

An update is known only once the optimizer made it, so it is measured in the optimizer's step
hooks: the pre-hook copies the optimizer's trainable parameters (this rank's shards) on their
device, the post-hook turns the copy into ``w_before - w_after`` in place (no second buffer),
takes each parameter's norm with multi-tensor ops and frees the copy. Nothing leaves the device.

The copy is shared: a :class:`StepDelta` is published for the step while it is held, and
GradientMonitor(update_ratio=True), whose logged-step snapshot would be a second copy of the
same parameters, reads each parameter's ``||Δw||²`` and ``||w_before||²`` from it instead
(``callbacks/_update_ratio.py``). The squares are computed once, by whichever post-hook asks first.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Optional
from weakref import WeakKeyDictionary

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_hooks.measure._sharding import local

#: The step deltas held now, by optimizer: each from its step pre-hook to the end of its post-hooks.
_HELD: WeakKeyDictionary[Any, StepDelta] = WeakKeyDictionary()


class StepDelta:
    """One copy of an optimizer's parameters before its step; after it, each parameter's update and weight squares.

    Args:
        params: The parameters (trainable, in the optimizer's order).
    """

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self.index = {id(p): i for i, p in enumerate(params)}
        with torch.no_grad():
            self._before: Optional[list[Tensor]] = [local(p).detach().clone() for p in params]
        self._squares: Optional[Tensor] = None

    @torch.no_grad()
    def squares(self) -> Tensor:
        """``(2, params)`` float64: each parameter's ``||w_after - w_before||²`` and ``||w_before||²`` (this rank's).

        Measured once, after the step, at the first call; the copy is freed then.
        """
        if self._squares is None:
            before = self._before
            assert before is not None
            weights = torch._foreach_norm(before, 2, dtype=torch.float32)
            torch._foreach_sub_(before, [local(p).detach() for p in self.params])  # now w_before - w_after, in place
            deltas = torch._foreach_norm(before, 2, dtype=torch.float32)
            self._squares = torch.stack([torch.stack(deltas), torch.stack(weights)]).double().square()
            self._before = None
        return self._squares


def held(optimizer: Any) -> Optional[StepDelta]:
    """The step delta ``optimizer``'s current step holds (between its step pre- and post-hooks), or None."""
    return _HELD.get(optimizer)


class UpdateNorms:
    """Each optimizer step's total update norm, on device: one copy of the parameters per step, shared.

    Attributes:
        copies: How many parameter copies it took (one per optimizer step).
    """

    def __init__(self) -> None:
        self.copies = 0
        self._norms: dict[int, Tensor] = {}  # by optimizer index: its last step's update norm (0-d float64)

    def register(self, optimizers: list[Any]) -> list[RemovableHandle]:
        """Put the step pre- and post-hooks on each optimizer; return their handles."""
        return [handle for key, optimizer in enumerate(optimizers)
                for handle in (optimizer.register_step_pre_hook(self._before_step),
                               optimizer.register_step_post_hook(partial(self._after_step, key)))]

    def take(self, key: int, device: torch.device) -> Tensor:
        """Optimizer ``key``'s last update norm, once (NaN: none made since the last take, or it was dropped)."""
        norm = self._norms.pop(key, None)
        return torch.full((), math.nan, dtype=torch.float64, device=device) if norm is None else norm.to(device)

    def forget(self) -> None:
        """Drop what was measured (a new fit)."""
        self._norms.clear()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if params:
            _HELD[optimizer] = StepDelta(params)
            self.copies += 1

    @torch.no_grad()
    def _after_step(self, key: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        delta = _HELD.pop(optimizer, None)
        if delta is None:
            return
        if all(p.grad is None for p in delta.params):  # GradientAnomalyStopping dropped it: no update made
            return
        norm = delta.squares()[0].sum().sqrt()
        self._norms[key] = torch.where(norm > 0, norm, math.nan)  # nothing moved (an LBFGS step undone): no update
