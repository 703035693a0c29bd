"""GradientAnomalyStopping: stop, skip, raise or warn when the gradients go bad."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
from torch import Tensor

from lightning_hooks.callbacks._anomaly_report import AnomalyReport
from lightning_hooks.callbacks._base import HookCallback, log_step
from lightning_hooks.callbacks._flight_leader import output_levels
from lightning_hooks.callbacks._gradient_check import GradientCheck
from lightning_hooks.callbacks._rollback import Rollback, check_strategy, rolled_back, validate_rollback
from lightning_hooks.callbacks._spike_check import SpikeWatch, StepJudges, validate_spikes
from lightning_hooks.callbacks._update_drop import UpdateDrop
from lightning_hooks.core._compat import callbacks_of
from lightning_hooks.core._validation import check_bool, check_choice, check_int
from lightning_hooks.core.selection import ModuleSelection
from lightning_hooks.distributed._rank_agreement import Check
from lightning_hooks.distributed._step_measure import Step
from lightning_hooks.measure.spikes import SpikeTrigger
from lightning_hooks.output.figures import FigureListener, ScalarBlock

Action = Literal["stop", "skip", "rollback", "raise", "warn"]
_ACTIONS = ("stop", "skip", "rollback", "raise", "warn")
_COUNTERS = ("streak", "anomalous_steps", "dropped_steps", "amp_overflows", "rollbacks")
_log = logging.getLogger(__name__)


class GradientAnomalyError(RuntimeError):
    """Raised by ``GradientAnomalyStopping(action="raise")``; ``report`` says what and where."""

    def __init__(self, report: AnomalyReport) -> None:
        super().__init__(str(report))
        self.report = report


class GradientAnomalyStopping(FigureListener, GradientCheck):
    """Act when gradients are non-finite, explode or vanish: stop, skip the update, roll back, raise or warn.

    The check runs at every optimizer step in ``on_before_optimizer_step`` (after gradient
    accumulation and AMP unscaling). A step is anomalous when any enabled flag fires for all
    gradients together or for any parameter group: a NaN or Inf gradient (``check_finite``), a
    norm above ``norm_threshold`` or above ``relative_threshold`` times its running median over the
    last ``window`` clean steps (exploding; with ``check_finite=False`` a NaN or Inf gradient
    counts as exploding), or below ``min_norm`` (vanishing). Steps the AMP GradScaler skips
    itself never count and leave the streak as it was (with fp16, a NaN from the model too).

    ``patience`` anomalous steps in a row are tolerated (and applied); the next one is acted on,
    so ``patience=0`` acts on the first. Then, with an :class:`~lightning_hooks.AnomalyReport`
    (logged as text, kept in :attr:`last_report`):

    - ``"stop"``: drops that step's update (the next one with ``act_late``, the default) and
      sets ``trainer.should_stop``, so ``fit`` ends
      after this step (the dropped step still counts in ``trainer.global_step``), as with
      ``EarlyStopping``; until Lightning's ``min_steps`` and ``min_epochs`` are met it trains
      on, and every further anomalous step is dropped too.
    - ``"skip"``: drops the update of this and every following anomalous step of the run
      (gradients set to None, so the optimizer leaves parameters and its state alone) and
      trains on. The global step and learning-rate schedules still advance.
    - ``"rollback"``: drops the update, restores the last known-good model, optimizer and LR
      scheduler state (a snapshot in host RAM, taken at the start of training and refreshed
      after every ``rollback_every_n_steps`` clean steps in a row), drops the updates of the
      next ``skip_batches`` optimizer steps and trains on, as large-model pretraining does by
      hand after a loss spike. ``trainer.global_step`` keeps counting every step; the LR
      schedules go back with the snapshot, and so do the spike windows, the running medians and
      the flight recorders. A second rollback to the same snapshot warns; a third stops. One
      device or DDP, one optimizer. Details: ``docs/spikes_and_rollback.md``.
    - ``"raise"``: raises :class:`GradientAnomalyError` carrying the report, before the update
      (before the next one with ``act_late``).
    - ``"warn"``: warns with the report, on rank zero, and applies the update.

    The report is built once per run of anomalous steps, when the action starts (beside a
    GradientMonitor it is the step's only one: the monitor leaves its report to this one);
    :attr:`last_flags` holds every step's flags. LBFGS, how an update is dropped (a step
    pre-hook) and the agreement across ranks (one small all-reduce): see the README. The streak
    and the running medians survive a resume; several instances can be used together when
    their ``action`` or thresholds differ. Works beside Lightning's ``EarlyStopping``.

    Args:
        modules: The modules ``provenance`` watches (None: leaf modules with parameters, and
            activation modules). The only argument taken by position; the others are keyword-only.
        action: What to do: ``"stop"``, ``"skip"``, ``"rollback"``, ``"raise"`` or ``"warn"``.
        patience: How many anomalous optimizer steps in a row to tolerate before acting.
        check_finite: Flag gradients that hold a NaN or an Inf.
        norm_threshold: Flag a group or total norm above this as exploding (it only flags; to clip,
            use the Trainer's ``gradient_clip_val``).
        relative_threshold: Flag a norm above this multiple of its running median as exploding.
        min_norm: Flag a group or total norm below this as vanishing.
        window: How many clean steps the running median covers.
        provenance: Watch module outputs for NaN/Inf, to report the first module in forward
            order whose output was non-finite.
        dirpath: Save the offending batch and the model state in this directory when acting, for
            replay.
        prog_bar: Show the streak of anomalous steps in the progress bar as ``anomaly_streak``.
        rollback_every_n_steps: With ``"rollback"``: refresh the snapshot after this many clean
            steps in a row (None: 100).
        skip_batches: With ``"rollback"``: after a restore, drop the updates of this many steps.
        spikes: Also flag ``"loss_spike"`` and ``"grad_norm_spike"`` (and, when asked,
            ``"update_norm_spike"``, at the check after the update): a robust z-score of the
            step's loss (as backpropagated), total gradient norm and update norm over a rolling
            window (:class:`~lightning_hooks.SpikeTrigger`), on device, agreed in the step's one
            collective.
        flight_recorder: Keep the last this many steps' loss and gradient norms on device (and
            update norms, when ``spikes`` watches them), and the modules' output std an
            ActivationMonitor logs; a report then carries them (:class:`~lightning_hooks.FlightRecord`:
            which layer left its usual range first, from its outputs where logged, how many
            steps before), also written next to the logs
            (``flight-record-step<N>.csv``) and to TensorBoard (``anomalies/flight_record``, and as
            JSON for the Layers tab, ``anomalies/flight_record_data``). 0: off.
        watch_after: After each step acted on, have the Trainer's GradientMonitor,
            ActivationMonitor and TransformerStability log every step, whatever their interval,
            for this many steps.
        act_late: With ``"warn"``, ``"raise"`` and ``"stop"`` (and neither ``provenance`` nor
            ``dirpath``), read each step's check a step later, with no blocking host read per
            step, and act there (the report names the anomalous step): its update is then
            applied, and ``"stop"`` drops the next one. False: read it before the update, which
            ``"stop"`` and ``"raise"`` then never apply. ``"skip"`` and ``"rollback"`` always read
            it before the update. See docs/cost.md.

    Raises:
        ValueError: For an unknown ``action``, a negative ``patience``, a bad threshold, no check
            enabled, a bad ``rollback_every_n_steps`` or ``skip_batches`` (or either without
            ``"rollback"``), and, before the first step, a rollback when sharded or with several optimizers.
        TypeError: For an argument of the wrong type: a flag that is not a bool, a count that is
            not an int, a threshold that is not a number, a ``dirpath`` that is not a path, a
            ``spikes`` that is not a :class:`~lightning_hooks.SpikeTrigger`.

    Example::

        from lightning import Trainer
        from lightning_hooks import GradientAnomalyStopping

        stopper = GradientAnomalyStopping(action="stop", patience=2, norm_threshold=1e4, provenance=True)
        trainer = Trainer(callbacks=[stopper])

    """

    def __init__(
        self,
        modules: ModuleSelection = None,
        *,
        action: Action = "stop",
        patience: int = 0,
        check_finite: bool = True,
        norm_threshold: Optional[float] = None,
        relative_threshold: Optional[float] = None,
        min_norm: Optional[float] = None,
        window: int = 50,
        provenance: bool = False,
        dirpath: Optional[Union[str, os.PathLike]] = None,
        prog_bar: bool = True,
        rollback_every_n_steps: Optional[int] = None,
        skip_batches: int = 0,
        spikes: Optional[SpikeTrigger] = None,
        flight_recorder: int = 0,
        watch_after: int = 0,
        act_late: bool = True,
    ) -> None:
        super().__init__(modules, check_finite, norm_threshold, relative_threshold, min_norm, window,
                         provenance, dirpath)
        check_choice("action", action, _ACTIONS)
        check_int("patience", patience, low=0)
        validate_spikes(spikes, flight_recorder, watch_after)
        if not self._detector.enabled_flags and spikes is None:
            raise ValueError(
                "nothing to check: set `check_finite=True`, or one of `norm_threshold`,"
                " `relative_threshold`, `min_norm`, `spikes`"
            )
        check_bool("prog_bar", prog_bar)
        check_bool("act_late", act_late)
        self.act_late = act_late
        validate_rollback(action, rollback_every_n_steps, skip_batches)
        self.action, self.patience, self.prog_bar = action, patience, prog_bar
        self.rollback_every_n_steps, self.skip_batches = rollback_every_n_steps, skip_batches
        self.spikes, self.flight_recorder, self.watch_after = spikes, flight_recorder, watch_after
        self._watch = SpikeWatch(spikes, flight_recorder)
        self._rollback = Rollback(rollback_every_n_steps or 100, skip_batches, StepJudges(self._detector, self._watch)
                                  ) if action == "rollback" else None
        self.rollbacks = 0
        #: With ``"rollback"``: (the step rolled back, the step whose starting state it went back to).
        self.last_rollback: Optional[tuple[int, int]] = None
        self.last_report: Optional[AnomalyReport] = None
        self.streak = 0
        self.anomalous_steps = 0
        self.dropped_steps = 0
        self.amp_overflows = 0
        self._dropper = UpdateDrop()
        self._streak_before = 0  # the streak before the current step
        self._settled = False  # the current step is counted anomalous: its later evaluations change nothing
        self._decided_for: Optional[tuple[int, int]] = None  # the optimizer step whose update decisions are made
        self._flags: tuple[str, ...] = ()

    def _key(self) -> dict[str, Any]:
        # Not `spikes`: adding a trigger on resume must not lose the counters and the running medians.
        return {"action": self.action, **super()._key()}

    @property
    def last_flags(self) -> tuple[str, ...]:
        """The flags fired at the last optimizer step checked, acted on or not, e.g. ``("loss_spike",)``."""
        return self._flags

    @property
    def skipping(self) -> int:
        """How many more optimizer steps' updates a rollback drops."""
        return self._rollback.skipping if self._rollback is not None else 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the step pre-hooks that drop updates (after tuners may have replaced the optimizers).

        With ``"rollback"``, take the first snapshot: the state training (or a resume) starts from.
        """
        if self._rollback is not None:
            check_strategy(trainer)
            self._rollback.take(trainer, pl_module)
        if self.action in ("stop", "skip", "rollback"):
            self._handles.extend(self._dropper.register(trainer.optimizers))
        if self._watch.updates is not None:  # after the dropper's: a dropped update is seen as one
            self._handles.extend(self._watch.updates.register(trainer.optimizers))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the step and the LR schedulers': refresh the snapshot, or roll back to it (a third time: stop)."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._rollback is not None and self._rollback.end_of_batch(trainer, pl_module):
            self.rollbacks, self.streak = self.rollbacks + 1, 0
            self.last_rollback = (trainer.global_step - 1, self._rollback.snapshot_step or 0)
            stop = rolled_back(self._rollback, self.last_report)
            if stop is not None:
                if trainer.is_global_zero:
                    _log.warning(stop)
                trainer.should_stop = True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """With ``"rollback"``: snapshot again if the optimizer's param groups changed (a backbone unfrozen)."""
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._rollback is not None:
            self._rollback.follow_groups(trainer, pl_module)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """Note the loss about to be backpropagated, on device, for ``spikes`` and ``flight_recorder``."""
        self._watch.add_loss(trainer, loss)

    def record_figures(self, figures: Sequence[ScalarBlock], metrics: Mapping[str, float], step: int) -> None:
        """With ``flight_recorder``: keep the modules' output (and output-gradient) std ActivationMonitor logs."""
        if self.flight_recorder:
            self._watch.outputs.add(step, output_levels(figures), output_levels(figures, "activation_grads"))

    def _votes(self, trainer: pl.Trainer, step: Step) -> dict[str, Tensor]:
        return self._watch.votes(step, first=self._shared is None or self._shared.evaluation == 1)

    def _may_wait(self, trainer: pl.Trainer) -> bool:
        """``warn``, ``raise`` and ``stop`` act a step late; ``skip`` and ``rollback`` need the answer at once."""
        return self.act_late and super()._may_wait(trainer) and self.action in ("warn", "raise", "stop")

    def detach(self) -> None:
        """Remove the hooks; free the rollback snapshot."""
        super().detach()
        self._decided_for = None
        self._watch.clear()
        self._dropper.release()
        if self._rollback is not None:
            self._rollback.release()

    def _handle(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, step: Step,
                check: Check) -> None:
        """Count the step at its first evaluation, or at a later one that finds it anomalous (LBFGS)."""
        check = self._watch.conclude(trainer, step, check)
        self._flags = tuple(name for name, on in check.flags.items() if on)
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
        if self._rollback is not None and self._rollback.skipping:  # passing over batches after a rollback
            self._rollback.decide(act=False, clean=False)
            self._settled = True
            self._dropper.drop(optimizer, self._evaluation)
            self.dropped_steps += 1
            return
        if not check.skipped:  # a step the scaler skipped says nothing: the streak stays
            self.streak = self.streak + 1 if check.anomalous else 0
        if self.prog_bar:
            self._show(trainer, pl_module, "anomaly_streak", self.streak)
        act = check.anomalous and self.streak > self.patience
        if self._rollback is not None and not check.skipped:  # a step the scaler skipped leaves the count
            self._rollback.decide(act, clean=not check.anomalous)
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

    def state_dict(self) -> dict[str, Any]:
        """Return the counters, the running median windows, and how many updates a rollback still drops.

        The rollback snapshot is not saved (it would double the checkpoint): on resume, the
        resumed state is the first snapshot. A step whose check waits to be read a step late is
        read and acted on first, as at the end of training (a checkpoint waits for the device
        anyway): a run resumed from it judges every step, the last one before it too.
        """
        if self._shared is not None:
            self._shared.finish(at_end=True)
        counters = {name: getattr(self, name) for name in (*_COUNTERS, "skipping")}
        last = {"last_rollback": list(self.last_rollback)} if self.last_rollback is not None else {}
        return {**counters, **last, **self._state(), **self._watch.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        for name in _COUNTERS:
            setattr(self, name, int(state_dict[name]))
        last = state_dict.get("last_rollback")
        self.last_rollback = (int(last[0]), int(last[1])) if last is not None else None
        if self._rollback is not None:
            self._rollback.skipping = int(state_dict["skipping"])
        self._watch.load_state_dict(state_dict)
        self._load_state(state_dict)

