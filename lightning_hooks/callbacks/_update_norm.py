"""The norm of every optimizer step's update ``||w_after - w_before||``, for ``SpikeTrigger(update_norm=...)``.

An update is known only once the optimizer made it, so it is measured in the optimizer's step
hooks: the pre-hook holds the optimizer's trainable parameters in its
:class:`~lightning_hooks.callbacks._step_copies.StepCopies` (one copy per step, shared with
UpdateTransform and GradientMonitor's update ratios: a parameter they hold for the same step is
not copied again); the post-hook takes one multi-tensor norm of ``w_after - w_before`` and lets
go, keeping the copies' memory for the next step's copy (every step holds). On the CPU the norm
is one pass over ``w_after`` and ``w_before`` that stores no update (``measure/_update_passes.py``)
and, when this reader is the copies' last, also leaves ``w_after`` in them: the next step holds
them without a copy where no parameter changed in between (``StepCopies.update_squares``). Elsewhere,
alone with its copies, it turns them into the update in place (no second buffer), and when
another reader holds them too, the differences are made a batch at a time (at most 2^24 values
more). Nothing leaves the device. The post-hook is put on at ``on_train_start``,
after UpdateTransform's (``on_fit_start``), so it measures the update UpdateTransform made.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_hooks.callbacks._step_copies import step_copies


class UpdateNorms:
    """Each optimizer step's total update norm (this rank's parameters or shards), on device."""

    def __init__(self) -> None:
        self._norms: dict[int, Tensor] = {}  # by optimizer index: its last step's update norm (0-d float64)
        self._holding: dict[int, tuple[Any, list[Tensor]]] = {}  # by id of optimizer: it, and the parameters held
        self._optimizers: list[Any] = []  # those whose step copies keep their memory for this reader's next step

    def register(self, optimizers: list[Any]) -> list[RemovableHandle]:
        """Put the step pre- and post-hooks on each optimizer; return their handles."""
        self._optimizers = list(optimizers)
        return [handle for key, optimizer in enumerate(optimizers)
                for handle in (optimizer.register_step_pre_hook(self._before_step),
                               optimizer.register_step_post_hook(partial(self._after_step, key)))]

    def take(self, key: int, device: torch.device) -> Tensor:
        """Optimizer ``key``'s last update norm, once (NaN: none made since the last take, or it was dropped)."""
        norm = self._norms.pop(key, None)
        return torch.full((), math.nan, dtype=torch.float64, device=device) if norm is None else norm.to(device)

    def forget(self) -> None:
        """Drop what was measured, and any copy still held (the end of a fit)."""
        self._norms.clear()
        for optimizer in self._optimizers:  # what it holds, and the memory kept for its next step
            step_copies(optimizer).release(self)
        self._holding.clear()
        self._optimizers = []

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if params:
            step_copies(optimizer).hold(self, params)
            self._holding[id(optimizer)] = optimizer, params

    @torch.no_grad()
    def _after_step(self, key: int, optimizer: Any, args: Any, kwargs: Any) -> None:
        held = self._holding.pop(id(optimizer), None)
        if held is None:
            return
        params, copies = held[1], step_copies(optimizer)
        before, alone = copies.copies(self), copies.exclusive(self)
        copies.release(self, keep=True)  # the list keeps them alive; alone, they are this hook's to change
        if all(p.grad is None for p in params):  # GradientAnomalyStopping dropped it: no update made
            return
        squares = copies.update_squares(params, before, alone, chain=True)  # every step holds: chain the copy
        norm = squares.sum().sqrt()
        self._norms[key] = torch.where(norm > 0, norm, math.nan)  # nothing moved (an LBFGS step undone): no update
