"""What GradientAnomalyStopping does with each checked step: count it, report it, and act.

:class:`AnomalyActions` receives each optimizer step's check (at once, or a step late: see
:meth:`_may_wait`), keeps the streak and the counters, builds the report once per run of
anomalous steps, and stops, skips, rolls back, raises or warns. With ``"rollback"`` it tells the
:class:`~lightning_hooks.callbacks._rollback.Rollback` what each check said, drops the updates a
rollback passes over, and restores at the end of the batch. The constructor, the arguments and
the checkpoint state are :class:`~lightning_hooks.callbacks.stopping.GradientAnomalyStopping`'s.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import lightning.pytorch as pl

from lightning_hooks.callbacks._anomaly_report import AnomalyReport
from lightning_hooks.callbacks._base import HookCallback, log_step, moment
from lightning_hooks.callbacks._gradient_check import GradientCheck
from lightning_hooks.callbacks._rollback import Rollback, rolled_back
from lightning_hooks.callbacks._spike_check import SpikeWatch
from lightning_hooks.callbacks._update_drop import UpdateDrop
from lightning_hooks.core._compat import callbacks_of
from lightning_hooks.distributed._rank_agreement import Check
from lightning_hooks.distributed._step_measure import Step
from lightning_hooks.output.figures import FigureListener

_log = logging.getLogger("lightning_hooks.callbacks.stopping")


class GradientAnomalyError(RuntimeError):
    """Raised by ``GradientAnomalyStopping(action="raise")``; ``report`` says what and where."""

    def __init__(self, report: AnomalyReport) -> None:
        super().__init__(str(report))
        self.report = report


class AnomalyActions(FigureListener, GradientCheck):
    """The acting half of :class:`~lightning_hooks.callbacks.stopping.GradientAnomalyStopping`, which sets its state."""

    action: str
    patience: int
    prog_bar: bool
    act_late: bool
    watch_after: int
    streak: int
    anomalous_steps: int
    dropped_steps: int
    amp_overflows: int
    rollbacks: int
    last_rollback: Optional[tuple[int, int]]
    last_report: Optional[AnomalyReport]
    _watch: SpikeWatch
    _rollback: Optional[Rollback]
    _dropper: UpdateDrop
    _streak_before: int
    _settled: bool
    _decided_for: Optional[tuple[int, int]]
    _flags: tuple[str, ...]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Check the step (read now or a step late); after a rollback, drop the updates it passes over."""
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        if self._rollback is not None and self._rollback.passing(trainer.global_step):
            self._dropper.drop(optimizer, self._evaluation)
            self.dropped_steps += 1

    def _may_wait(self, trainer: pl.Trainer) -> bool:
        """``warn``, ``raise``, ``stop`` and ``rollback`` act a step late; ``skip`` needs the answer at once."""
        return self.action != "skip" and self.act_late and super()._may_wait(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the step and the LR schedulers': refresh the snapshot, or roll back to it (a third time: stop)."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._settle_rollback(trainer, pl_module)

    def _settle_rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rollback is not None and self._rollback.end_of_batch(trainer, pl_module):
            self.rollbacks, self.streak = self.rollbacks + 1, 0
            self.last_rollback = (self._rollback.returns[-1], self._rollback.snapshot_step or 0)
            stop = rolled_back(self._rollback, self.last_report, trainer)
            if stop is not None:
                if trainer.is_global_zero:
                    _log.warning(stop)
                trainer.should_stop = True

    def _handle(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, step: Step,
                check: Check) -> None:
        """Count the step at its first evaluation, or at a later one that finds it anomalous (LBFGS)."""
        check = self._watch.conclude(trainer, step, check)
        self._flags = tuple(name for name, on in check.flags.items() if on) if check.anomalous else ()
        step_now = (id(optimizer), trainer.global_step)
        if self._evaluation != 1 or self._decided_for != step_now:  # not right after a late read decided for it
            self._dropper.new_evaluation(first=self._evaluation == 1)
        self._decided_for = step_now
        if self._evaluation == 1:
            self._streak_before, self._settled = self.streak, False
        else:
            self._dropper.snapshot.reevaluating.add(id(optimizer))
            if self._settled or not check.anomalous or check.skipped:
                return
            self.streak = self._streak_before  # the step's first evaluations were clean: count it again
        self._settled = check.anomalous
        self._act_on(trainer, pl_module, optimizer, step, check)

    def _act_on(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, step: Step,
                check: Check) -> None:
        self.amp_overflows += bool(check.amp_overflow)
        self.anomalous_steps += check.anomalous
        rollback = self._rollback
        if rollback is not None:  # the step measured, and the update about to be made: read by the rollback alone
            measured, update = moment(trainer).global_step, None if self._at_end else trainer.global_step
            if rollback.pass_over(measured):  # measured on a discarded state
                self._settled = True
                return
        if not check.skipped:  # a step the scaler skipped says nothing: the streak stays
            self.streak = self.streak + 1 if check.anomalous else 0
        if self.prog_bar:
            self._show(trainer, pl_module, "anomaly_streak", self.streak)
        act = check.anomalous and self.streak > self.patience
        if rollback is not None and not check.skipped:  # a step the scaler skipped leaves the count
            rollback.decide(act, not check.anomalous, measured, update, trainer, pl_module)
        if not act:
            return
        if self.watch_after:  # the monitors log every step for a while
            for callback in callbacks_of(trainer, HookCallback):
                callback.watch_until(log_step(trainer) + self.watch_after)
        if self.streak == self.patience + 1:  # report once per run of anomalous steps
            names = [self._param_names.get(p, f"param{i}") for i, p in enumerate(step.params)]
            record = self._watch.record(trainer, names, step.key)
            self.last_report = report = self._report(trainer, pl_module, step, check, record)
            if self.action == "raise":
                raise GradientAnomalyError(report)
            if self.action in ("warn", "stop") and trainer.is_global_zero:
                _log.warning(f"GradientAnomalyStopping: {'stopping' if self.action == 'stop' else 'training on'}."
                            f"\n{report}")
        if self.action in ("stop", "skip", "rollback") and not self._at_end:  # at the end no update follows
            self._dropper.drop(optimizer, self._evaluation)
            self.dropped_steps += 1
        if self.action == "stop":
            trainer.should_stop = True
        if self._at_end:  # read at the end of training or at a checkpoint: no batch end follows to restore
            self._settle_rollback(trainer, pl_module)
