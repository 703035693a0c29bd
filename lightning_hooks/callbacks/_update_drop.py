"""How GradientAnomalyStopping drops an optimizer step's update, once every hook has seen its gradients.

An update is dropped in the optimizer's step pre-hook (after the closure, when ``step`` gets
one): the gradients are set to None, so that the optimizer leaves parameters and its state
alone. An optimizer that evaluates its closure again within a step (LBFGS) moves the
parameters between evaluations, so its dropped steps are undone whole in the step post-hook,
from a :class:`StepSnapshot` taken before the step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.hooks import RemovableHandle


class StepSnapshot:
    """The parameters and state an optimizer starts a step from, for an optimizer that evaluates its closure again.

    LBFGS moves the parameters between the evaluations of its closure, so an anomaly seen at a
    later evaluation comes after the step began to change them, and setting the gradients to
    None is too late: dropping such a step puts the parameters and the optimizer's state back
    as they were before it. Taken before each step of such an optimizer only (LBFGS, and any
    optimizer once seen evaluating its closure again), on its device: one copy of its
    parameters and of its state (with LBFGS, its history of up to ``2 * history_size`` flat
    vectors).
    """

    def __init__(self) -> None:
        self.reevaluating: set[int] = set()  # ids of optimizers seen evaluating their closure again
        self._optimizer: Any = None
        self._params: list[Tensor] = []
        self._state: dict[str, Any] = {}

    def wanted(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s steps need a snapshot to be dropped."""
        return isinstance(optimizer, torch.optim.LBFGS) or id(optimizer) in self.reevaluating

    def take(self, optimizer: Any) -> None:
        """Copy ``optimizer``'s parameters and state, on their device."""
        self._optimizer = optimizer
        self._params = [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]
        self._state = apply_to_collection(optimizer.state_dict(), Tensor, lambda t: t.detach().clone())

    def holds(self, optimizer: Any) -> bool:
        """Whether the snapshot is of ``optimizer``'s current step."""
        return self._optimizer is not None and self._optimizer is optimizer

    @torch.no_grad()
    def restore(self) -> None:
        """Put the parameters and the optimizer's state back as they were before the step."""
        params = [p for group in self._optimizer.param_groups for p in group["params"]]
        for param, saved in zip(params, self._params):
            param.copy_(saved)
        self._optimizer.load_state_dict(self._state)

    def release(self) -> None:
        """Drop the copies."""
        self._optimizer, self._params, self._state = None, [], {}


def _drop_update(optimizer: Any) -> None:
    """Set every gradient of ``optimizer`` to None, so that its step leaves parameters and state alone."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


class UpdateDrop:
    """Drops the updates decided on, through step pre- and post-hooks on the optimizers."""

    def __init__(self) -> None:
        self.snapshot = StepSnapshot()
        self._drop: Any = None  # the optimizer whose coming update is to be dropped
        self._undo: Any = None  # the optimizer whose step is to be undone from the snapshot

    def register(self, optimizers: list[Any]) -> list[RemovableHandle]:
        """Register the step hooks on ``optimizers``; return their handles."""
        return [handle for opt in optimizers
                for handle in (opt.register_step_pre_hook(self._before_step),
                               opt.register_step_post_hook(self._after_step))]

    def new_evaluation(self, first: bool) -> None:
        """Forget the decision of the closure's last evaluation; at a step's first, the last step's too."""
        self._drop = None
        if first:
            self._undo = None

    def drop(self, optimizer: Any, evaluation: int) -> None:
        """Drop the update of ``optimizer``'s current step, decided at the closure's ``evaluation``."""
        self._drop = self._undo = optimizer
        if evaluation > 1 and not self.snapshot.holds(optimizer):
            rank_zero_warn(f"GradientAnomalyStopping: {type(optimizer).__name__} evaluated its closure again"
                           " within a step and moved the parameters before the anomaly: this step's update"
                           " is dropped from here on only; its later steps are undone whole.")

    def release(self) -> None:
        """Drop the snapshot."""
        self.snapshot.release()

    def _before_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[Any]:
        """Step pre-hook: drop the update decided on, once every hook has seen the gradients.

        Lightning's default and bf16 precision pass ``step`` a closure that runs backward and
        then the ``on_before_optimizer_step`` hooks, so the drop follows the closure. Under a
        GradScaler the closure has run before ``step``, which the scaler calls only when the
        gradients are finite. An optimizer that evaluates its closure again (LBFGS) gets its
        parameters and state copied first, to undo the step if a later evaluation is anomalous.
        """
        if self.snapshot.wanted(optimizer):
            self.snapshot.take(optimizer)
        closure: Optional[Callable[[], Any]] = kwargs.get("closure")
        if closure is None:
            self._drop_if_decided(optimizer)
            return None

        def closure_then_drop() -> Any:
            loss = closure()
            self._drop_if_decided(optimizer)
            return loss

        return args, {**kwargs, "closure": closure_then_drop}

    def _drop_if_decided(self, optimizer: Any) -> None:
        if self._drop is optimizer:
            _drop_update(optimizer)
        self._drop = None

    def _after_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Step post-hook: undo a dropped step of an optimizer that evaluated its closure again."""
        if self.snapshot.holds(optimizer):
            if self._undo is optimizer:
                self.snapshot.restore()
            self.snapshot.release()
        self._undo = None
