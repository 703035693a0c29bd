"""How UpdateTransform changes one optimizer step's update: a snapshot before, a rewrite after.

The step pre-hook holds the selected parameters (this rank's shards) in the optimizer's
:class:`~lightning_hooks.callbacks._step_copies.StepCopies`: the one copy a step holds, shared
with GradientMonitor's update ratios. The step post-hook works out a factor ``f`` per parameter
on the device (:func:`update_factors`) and moves each parameter to ``w_before + f Δw``. Alone
with the copy it turns the copy into ``w_before - w_after`` in place and adds
``(1 - f) (w_before - w_after)`` to the parameter: a factor of 1 leaves the optimizer's result
exactly as it was. When another reader holds the copy too, the copy stays as it is and ``Δw`` is
made in the parameter itself (``w_after - w_before``, times ``f``, plus ``w_before``: a factor
of 1 gives the optimizer's result to one rounding). No figure leaves the device and, with
sharded parameters, the norms are summed over the shards in one collective.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_hooks.callbacks._step_copies import step_copies
from lightning_hooks.callbacks._update_plan import OptimizerPlan
from lightning_hooks.measure._sharding import ShardGroupCache, local
from lightning_hooks.measure._update_passes import squares

#: Makes an optimizer's part of the plan (None: the plan reaches none of its parameters).
Planner = Callable[[Any], Optional[OptimizerPlan]]

_TINY = 1e-6  # the floor of a history's standard deviation and of a clipped norm, as Levanter's


class NormHistory:
    """The last ``window`` update norms of each ``clip_to_history`` group, on the device.

    A norm above ``mean + sigmas * std`` of its group's history is clipped to that bound; no
    clipping until the history holds ``max(2, window // 2)`` norms. The history keeps the norms
    before clipping (a clipped history would only shrink), and no non-finite one.
    """

    def __init__(self, groups: int, window: int, sigmas: float) -> None:
        self.groups, self.window, self.sigmas = groups, window, sigmas
        self.norms: Optional[Tensor] = None  # (groups, window), NaN where empty
        self.index = 0

    def _buffer(self, device: torch.device) -> Tensor:
        if self.norms is None:
            self.norms = torch.full((self.groups, self.window), float("nan"), dtype=torch.float64, device=device)
        elif self.norms.device != device:
            self.norms = self.norms.to(device)
        return self.norms

    def clip(self, norms: Tensor) -> Tensor:
        """The factor (at most 1) bringing each group's ``norms`` within its history's bound; then remember them."""
        history = self._buffer(norms.device)
        valid = ~history.isnan()
        count = valid.sum(1)
        mean = history.nan_to_num().sum(1) / count.clamp(min=1)
        spread = torch.where(valid, history - mean[:, None], 0.0).square().sum(1) / count.clamp(min=1)
        bound = mean + self.sigmas * spread.sqrt().clamp(min=_TINY)
        bound = torch.where(count >= max(2, self.window // 2), bound, torch.inf)
        norms = norms.double()
        factor = torch.where(norms > bound, bound / norms.clamp(min=_TINY), 1.0)
        history[:, self.index] = torch.where(norms.isfinite(), norms, torch.nan)
        self.index = (self.index + 1) % self.window
        return factor

    def state_dict(self) -> dict[str, Any]:
        """The norms (on the host) and where the next one goes."""
        return {"norms": None if self.norms is None else self.norms.cpu(), "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave (moved to the device at the next step)."""
        norms = state.get("norms")
        if norms is not None and tuple(norms.shape) != (self.groups, self.window):
            raise ValueError(f"UpdateTransform: the checkpoint's history is {tuple(norms.shape)}, this callback"
                             f" keeps {(self.groups, self.window)}: keep `clip_to_history` and `history_window`"
                             " as they were, or start the history afresh")
        self.norms, self.index = norms, int(state.get("index", 0))


def update_factors(plan: OptimizerPlan, weight_sq: Tensor, delta_sq: Tensor, history: Optional[NormHistory]) -> Tensor:
    """Each parameter's update factor: its scale, then its ratio cap, then its group's clip against history.

    Args:
        plan: The optimizer's part of the plan (with its tensors).
        weight_sq: Each parameter's ``||w_before||²`` (summed over shards), float64.
        delta_sq: Each parameter's ``||Δw||²`` as the optimizer made it, float64.
        history: The groups' norm history; None without ``clip_to_history``.

    Returns:
        A float64 tensor of one factor per parameter. A parameter that was all zeros before the
        step has no ratio (``||w|| = 0``): it is not capped.
    """
    assert plan.scales is not None and plan.max_ratios is not None and plan.groups is not None
    factor = plan.scales.double()
    delta = delta_sq.sqrt() * factor.abs()
    bound = plan.max_ratios.double() * weight_sq.sqrt()
    cap = torch.where((weight_sq > 0) & (delta > bound), bound / delta.clamp(min=torch.finfo(torch.float64).tiny), 1.0)
    factor, delta = factor * cap, delta * cap
    if history is not None:
        grouped = plan.groups >= 0
        index = plan.groups.clamp(min=0)
        group_sq = torch.zeros(plan.group_count, dtype=torch.float64, device=delta.device)
        group_sq.index_add_(0, index, torch.where(grouped, delta.square(), 0.0))
        clip = history.clip(group_sq.sqrt())
        factor = factor * torch.where(grouped, clip[index], 1.0)
    return factor


class StepRewrite:
    """The snapshot of one step and its rewrite, for each optimizer of a fit.

    Each optimizer's part of the plan is made again when its param groups change (a group added,
    as Lightning's ``BackboneFinetuning`` adds the unfrozen backbone's; a group's parameters
    changed in number): checked at each step by the groups' sizes, a few Python operations.
    """

    def __init__(self, window: int, sigmas: float) -> None:
        self.window, self.sigmas = window, sigmas
        self.plans: dict[int, Optional[OptimizerPlan]] = {}  # by id of optimizer
        self.histories: dict[int, NormHistory] = {}  # by index of optimizer in the trainer
        self._index: dict[int, int] = {}
        self._planners: dict[int, Planner] = {}
        self._layouts: dict[int, tuple[int, ...]] = {}  # the sizes of the param groups each plan was made for
        self._holding: dict[int, Any] = {}  # by id of optimizer: an optimizer whose step copies this holds
        self._optimizers: dict[int, Any] = {}  # by id: every optimizer taken charge of (their copies' memory kept)
        self._shard_groups = ShardGroupCache()

    def add(self, index: int, optimizer: Any, planner: Planner) -> None:
        """Take charge of ``optimizer`` (the ``index``-th of the trainer); ``planner`` makes its part of the plan."""
        self._index[id(optimizer)], self._planners[id(optimizer)] = index, planner
        self._optimizers[id(optimizer)] = optimizer
        self._plan(optimizer)

    def _plan(self, optimizer: Any) -> Optional[OptimizerPlan]:
        """``optimizer``'s part of the plan, made again if its param groups changed since it was made."""
        layout = tuple(len(group["params"]) for group in optimizer.param_groups)
        if self._layouts.get(id(optimizer)) != layout:
            self._layouts[id(optimizer)] = layout
            plan = self.plans[id(optimizer)] = self._planners[id(optimizer)](optimizer)
            index = self._index[id(optimizer)]
            if plan is not None and plan.group_count and index not in self.histories:
                self.histories[index] = NormHistory(plan.group_count, self.window, self.sigmas)
        return self.plans[id(optimizer)]

    def forget(self) -> None:
        """Drop the plans and any snapshot (the histories stay: they are part of the callback's state)."""
        self.plans.clear()
        self._index.clear()
        self._planners.clear()
        self._layouts.clear()
        for optimizer in self._optimizers.values():  # what it holds, and the memory kept for its next step
            step_copies(optimizer).release(self)
        self._holding.clear()
        self._optimizers.clear()
        self._shard_groups.clear()

    @torch.no_grad()
    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step pre-hook: hold the parameters the step may move (one copy, on their device, shared)."""
        plan = self._plan(optimizer) if id(optimizer) in self._planners else None
        if plan is not None:
            step_copies(optimizer).hold(self, plan.params, squares=plan.scales is not None)  # measured: ||w_before||²
            self._holding[id(optimizer)] = optimizer

    @torch.no_grad()
    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step post-hook: rewrite the update; a dropped update (every gradient None) is left alone."""
        plan, copies = self.plans.get(id(optimizer)), step_copies(optimizer)
        if self._holding.pop(id(optimizer), None) is None or plan is None:
            return
        before, alone = copies.copies(self), copies.exclusive(self)
        weight = copies.squares(self) if plan.scales is not None else None  # summed as they were copied
        copies.release(self, keep=True)  # the list keeps them alive; the memory kept for the next step's copy
        if all(p.grad is None for group in optimizer.param_groups for p in group["params"]):
            return  # GradientAnomalyStopping dropped it: nothing moved, no norm to remember
        after = [local(p).detach() for p in plan.params]
        if not alone:
            self._rewrite_in_parameters(optimizer, plan, before, after, weight)
            return
        if weight is None:
            torch._foreach_sub_(before, after)  # w_before - w_after
            torch._foreach_mul_(before, [1.0 - s for s in plan.scale_list])
        else:
            factor = self._factors(optimizer, plan, before, after, weight)
            torch._foreach_mul_(before, list((1.0 - factor).unbind()))  # 0-dim float64: each keeps its dtype
        torch._foreach_add_(after, before)

    def _rewrite_in_parameters(self, optimizer: Any, plan: OptimizerPlan, before: list[Tensor],
                               after: list[Tensor], weight: Optional[Tensor]) -> None:
        """The rewrite leaving the copy as it is (another reader measures the update from it): Δw in the parameters."""
        torch._foreach_sub_(after, before)  # the parameters hold w_after - w_before
        if weight is None:
            torch._foreach_mul_(after, plan.scale_list)
        else:
            torch._foreach_mul_(after, list(self._measured(optimizer, plan, weight, squares(after)).unbind()))
        torch._foreach_add_(after, before)

    def _factors(self, optimizer: Any, plan: OptimizerPlan, before: list[Tensor], after: list[Tensor],
                 weight: Tensor) -> Tensor:
        torch._foreach_sub_(before, after)  # now w_before - w_after
        return self._measured(optimizer, plan, weight, squares(before))

    def _measured(self, optimizer: Any, plan: OptimizerPlan, weight: Tensor, delta: Tensor) -> Tensor:
        """The factors from each parameter's ``||w_before||²`` and ``||Δw||²`` (float64; summed over shards).

        Float64 sums of the update passes (``measure._update_passes``): ``||w_before||²`` summed as the
        step copy was made, ``||Δw||²`` after the step; float64 parameters are measured too.
        """
        both = torch.stack([weight, delta])
        shards = self._shard_groups(plan.params)
        if shards.sharded:  # one collective: every rank gets the whole parameters' norms
            both = shards.sum_(both.T.contiguous()).T
        history = self.histories.get(self._index[id(optimizer)])
        return update_factors(plan, both[0], both[1], history)
