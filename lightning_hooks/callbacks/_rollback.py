"""Rollback for GradientAnomalyStopping: the last known-good training state on the host, and its restore."""

from __future__ import annotations

import copy
import logging
from typing import Any, Literal, Optional, Protocol, runtime_checkable

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_hooks.core._compat import callbacks_of
from lightning_hooks.core._validation import check_int

_log = logging.getLogger(__name__)

Outcome = Literal["rollback", "skipped", "refresh"]


def _host_copy(state: Any) -> Any:
    """``state`` with every tensor copied to the host: no tensor shared with the original."""
    return apply_to_collection(state, Tensor, lambda t: t.detach().to("cpu", copy=True))


def check_strategy(trainer: pl.Trainer) -> None:
    """Raise unless every rank holds the whole model and optimizer state (one device, or DDP).

    Raises:
        ValueError: Under FSDP, DeepSpeed or another sharding strategy, or with several optimizers.
    """
    strategy = trainer.strategy
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or isinstance(strategy, DeepSpeedStrategy):
        raise ValueError(
            f"`action='rollback'` needs the whole model and optimizer state on every rank (one device or"
            f" DDP), got the {type(strategy).__name__}; use `action='skip'` or 'stop' with it"
        )
    if len(trainer.optimizers) != 1:
        raise ValueError(f"`action='rollback'` supports one optimizer, got {len(trainer.optimizers)}")


def validate_rollback(action: str, every_n_steps: Any, skip_batches: Any) -> None:
    """Check the rollback arguments of GradientAnomalyStopping.

    Raises:
        ValueError: For a bad value, or either set without ``action="rollback"``.
    """
    check_int("rollback_every_n_steps", every_n_steps, optional=True)
    check_int("skip_batches", skip_batches, low=0)
    if action != "rollback" and (every_n_steps is not None or skip_batches):
        raise ValueError(
            f"`rollback_every_n_steps` and `skip_batches` work with `action='rollback'` only, got"
            f" action={action!r}: set action='rollback' or leave them out"
        )


@runtime_checkable
class Judges(Protocol):
    """Whatever judges the steps (spike windows, running medians, flight rings): copied and restored with a snapshot.

    A callback of the Trainer that has these two methods opts in: its judges go back with every
    rollback too (UpdateTransform's norm history).
    """

    def copy_judges(self) -> Any:
        """A copy of the judges' state, which later steps do not change."""

    def restore_judges(self, judges: Any) -> None:
        """Put a :meth:`copy_judges` back."""


def _groups(trainer: pl.Trainer) -> tuple[int, ...]:
    """The optimizer's param groups, as the number of parameters in each: a snapshot restores into the same."""
    return tuple(len(group["params"]) for group in trainer.optimizers[0].param_groups)


class Rollback:
    """One snapshot of model, optimizer and LR scheduler state on the host, refreshed every N clean steps.

    Each step's check is read either before its own update (at once) or before the next
    step's (a step late, with no blocking read per step, or at a checkpoint or the end of
    training, where no update follows). :meth:`decide` notes each check read; :meth:`pass_over`
    says which checks go unjudged (measured on a state a rollback discards), and
    :meth:`passing` which updates are dropped after a restore. :meth:`end_of_batch`, once the step and the LR
    schedulers' step are done, restores the snapshot, refreshes it, or holds the schedules still
    while batches are passed over. What judges the steps goes back with the snapshot: the
    restored model's values are judged against the windows of its own time, not those of the
    discarded steps.

    A rollback decided before update ``u`` (the check of step ``u``, or, read late, of
    ``u - 1``, whose update is discarded by the restore) drops ``u`` and the next
    ``skip_batches`` updates; no check of a step before :attr:`resume_at` is judged.

    Args:
        every_n_steps: Refresh the snapshot after this many clean optimizer steps in a row.
        skip_batches: After a restore, drop the updates of this many optimizer steps.
        judges: What judges the steps, copied with each snapshot and restored with it.
    """

    def __init__(self, every_n_steps: int, skip_batches: int, judges: Optional[Judges] = None) -> None:
        self.every_n_steps, self.skip_batches, self.judges = every_n_steps, skip_batches, judges
        self.resume_at = 0  # the first step whose check is judged, and whose update is made, after a rollback
        self.skipping = 0  # optimizer steps still to pass over, at the end of the last batch
        self.snapshot_step: Optional[int] = None  # the global step the snapshot was taken before
        self.returns: list[int] = []  # the steps rolled back to this snapshot
        self._state: dict[str, Any] = {}
        self._clean = 0  # clean steps in a row since the snapshot
        self._outcome: Optional[Outcome] = None

    def take(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Copy the model, the optimizer and the LR schedulers' states to the host, and the judges' states.

        The judges: ours, and those of the Trainer's callbacks that opt in (see :class:`Judges`).
        """
        self._state = {
            "model": _host_copy(pl_module.state_dict()),
            "optimizer": _host_copy(trainer.optimizers[0].state_dict()),
            "schedulers": [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs],
            "groups": _groups(trainer),
            "judges": self.judges.copy_judges() if self.judges is not None else None,
            "callbacks": [(c, c.copy_judges()) for c in callbacks_of(trainer, Judges)],  # type: ignore[type-abstract]
        }
        self.snapshot_step, self._clean, self.returns = trainer.global_step, 0, []

    def follow_groups(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Take a new snapshot if the optimizer's param groups changed since (a backbone unfrozen); return whether.

        Called before a step: the old snapshot could not be loaded into the optimizer any more.
        """
        if not self._state or self._state["groups"] == _groups(trainer):
            return False
        self.take(trainer, pl_module)
        return True

    def release(self) -> None:
        """Free the snapshot (at the end of ``fit``)."""
        self._state, self._outcome = {}, None

    def pass_over(self, measured: int) -> bool:
        """Whether the check of step ``measured`` goes unjudged: measured on a state a rollback discards.

        That is a step measured before :attr:`resume_at` (before the restore, or passed over
        after it), or any read in the batch a rollback is decided in. What it added to the judges
        is taken back at once (in that batch, at its end, with the restore).
        """
        if self._outcome == "rollback":
            return True
        if measured >= self.resume_at:
            return False
        self._restore_judges()
        return True

    def passing(self, update: int) -> bool:
        """Whether update ``update`` is one a rollback passes over, to drop: asked once per step, read or not.

        The updates after a restore up to :attr:`resume_at`; their LR schedules are held still.
        """
        if self._outcome in ("rollback", "skipped") or update >= self.resume_at:
            return False
        self._outcome = "skipped"
        return True

    def decide(self, act: bool, clean: bool, measured: int, update: Optional[int], trainer: pl.Trainer,
               pl_module: pl.LightningModule) -> None:
        """Note the check of step ``measured`` (acted on, or clean), read before update ``update`` (None: none).

        A clean step read before a later update (or none) than its own is in the state now:
        a due snapshot is taken at once; one read before its own update, at the end of the batch.
        """
        if act:
            self._outcome, self.returns = "rollback", [*self.returns, measured]
            self.resume_at = (measured if update is None else update) + 1 + self.skip_batches
        elif not clean:  # an anomalous step tolerated (patience): the count starts again
            self._clean = 0
        else:
            self._clean += 1
            if self._clean >= self.every_n_steps and update == measured:
                self._outcome = "refresh"
            elif self._clean >= self.every_n_steps:
                self.take(trainer, pl_module)

    def end_of_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Act on what :meth:`decide` and :meth:`pass_over` noted; return whether the state was rolled back."""
        outcome, self._outcome = self._outcome, None
        if outcome == "rollback":
            pl_module.load_state_dict(self._state["model"])  # copies into the parameters, in place
            trainer.optimizers[0].load_state_dict(_host_copy(self._state["optimizer"]))  # no alias of ours
            self._restore_schedules(trainer)
            self._restore_judges()
            self._clean = 0
        elif outcome == "skipped":  # nothing moved but the LR schedules, stepped by Lightning: back they go
            self._restore_schedules(trainer)
            self._restore_judges()  # and the judges, which the optimizer's step hooks may have fed since
            groups = self._state["optimizer"]["param_groups"]
            for group, saved in zip(trainer.optimizers[0].param_groups, groups):
                group.update({key: value for key, value in saved.items() if key != "params"})
        elif outcome == "refresh":
            self.take(trainer, pl_module)
        self.skipping = max(0, self.resume_at - trainer.global_step)
        return outcome == "rollback"

    def _restore_judges(self) -> None:
        if self.judges is not None and self._state["judges"] is not None:
            self.judges.restore_judges(self._state["judges"])
        for callback, judges in self._state["callbacks"]:
            callback.restore_judges(judges)

    def _restore_schedules(self, trainer: pl.Trainer) -> None:
        for config, state in zip(trainer.lr_scheduler_configs, self._state["schedulers"]):
            config.scheduler.load_state_dict(copy.deepcopy(state))


def _stop_held(trainer: pl.Trainer) -> Optional[str]:
    """The Lightning setting that keeps ``trainer.should_stop`` from ending ``fit`` now, if any."""
    loop = trainer.fit_loop
    if loop.min_steps and trainer.global_step < loop.min_steps:
        return f"min_steps={loop.min_steps}"
    if loop.min_epochs and trainer.current_epoch < loop.min_epochs:
        return f"min_epochs={loop.min_epochs}"
    return None


def rolled_back(rollback: Rollback, report: Any, trainer: pl.Trainer) -> Optional[str]:
    """Say that a rollback happened; return why training must stop, or None.

    Once back to a snapshot is routine (info); twice is a warning: training from that state met
    another anomaly before ``every_n_steps`` clean steps made a new snapshot. The third time,
    the rollbacks would only go round in a loop, discarding the same steps: training stops,
    with the last report, at the restored state. Where Lightning's ``min_steps`` or
    ``min_epochs`` keeps it going, the warning says so, at each further rollback.

    Args:
        rollback: The rollback, just restored.
        report: The last anomaly report (printed when it stops).
        trainer: The trainer, for its ``min_steps`` and ``min_epochs``.
    """
    to, returns = rollback.snapshot_step or 0, rollback.returns
    step = returns[-1]
    said = (f"GradientAnomalyStopping: step {step} rolled back to the state before step {to}; dropping the next"
            f" {rollback.skip_batches} updates.")
    if len(returns) == 1:
        rank_zero_only(_log.info)(said)
        return None
    steps = ", ".join(map(str, returns))
    if len(returns) == 2:
        rank_zero_only(_log.warning)(f"{said} The second rollback to that state (steps {steps}): training from it"
                                     " met another anomaly before a new snapshot; a third stops training.")
        return None
    held = _stop_held(trainer)
    going_on = (f" Lightning's `{held}` is not met: it trains on from that state, looping until then."
                if held is not None else "")
    return (f"GradientAnomalyStopping: stopping at step {step}: {len(returns)} rollbacks to the state before step"
            f" {to} (steps {steps}); rolling back again would loop. The model is left in that state.{going_on}"
            f" Look at the batches after step {to}, or the thresholds (a `spikes` trigger flagging ordinary"
            f" steps?).\nThe last report:\n{report}")
