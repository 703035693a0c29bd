"""GradientAnomalyStopping: stop, skip, raise or warn when the gradients go bad."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
from torch import Tensor

from lightning_hooks.callbacks._anomaly_actions import AnomalyActions, GradientAnomalyError
from lightning_hooks.callbacks._anomaly_report import AnomalyReport
from lightning_hooks.callbacks._flight_leader import output_levels
from lightning_hooks.callbacks._rollback import Rollback, check_strategy, validate_rollback
from lightning_hooks.callbacks._spike_check import SpikeWatch, StepJudges, validate_spikes
from lightning_hooks.callbacks._update_drop import UpdateDrop
from lightning_hooks.core._validation import check_bool, check_choice, check_int
from lightning_hooks.core.selection import ModuleSelection
from lightning_hooks.distributed._step_measure import Step
from lightning_hooks.measure.spikes import SpikeTrigger
from lightning_hooks.output.figures import ScalarBlock

Action = Literal["stop", "skip", "rollback", "raise", "warn"]
_ACTIONS = ("stop", "skip", "rollback", "raise", "warn")
_COUNTERS = ("streak", "anomalous_steps", "dropped_steps", "amp_overflows", "rollbacks")
__all__ = ["GradientAnomalyError", "GradientAnomalyStopping"]


class GradientAnomalyStopping(AnomalyActions):
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
    - ``"rollback"``: drops the update (with ``act_late``, applies it and drops the next one),
      restores the last known-good model, optimizer and LR
      scheduler state (a snapshot in host RAM, taken at the start of training and refreshed
      after every ``rollback_every_n_steps`` clean steps in a row, each checked), drops the updates of the
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
        modules: The modules ``provenance`` watches (None: every module whose parameters are all
            its own, and activation modules: see ``is_default_module``). The only argument taken
            by position; the others are keyword-only.
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
        act_late: With ``"warn"``, ``"raise"``, ``"stop"`` and ``"rollback"`` (and neither
            ``provenance`` nor ``dirpath``), read each step's check a step later, with no
            blocking host read per step, and act there (the report names the anomalous step):
            its update is then applied, ``"stop"`` drops the next one, and ``"rollback"`` drops
            the next one and restores. At a checkpoint the step waiting is read and acted on
            first. False: read it before the update, which ``"stop"``, ``"raise"`` and
            ``"rollback"`` then never apply. ``"skip"`` always reads it before the update. See
            docs/cost.md.

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

    def detach(self) -> None:
        """Remove the hooks; free the rollback snapshot."""
        super().detach()
        self._decided_for = None
        self._watch.clear()
        self._dropper.release()
        if self._rollback is not None:
            self._rollback.release()

    def state_dict(self) -> dict[str, Any]:
        """Return the counters, the running median windows, and how many updates a rollback still drops.

        The rollback snapshot is not saved (it would double the checkpoint): on resume, the
        resumed state is the first snapshot. A step whose check waits to be read a step late is
        read and acted on first, as at the end of training (a checkpoint waits for the device
        anyway): a run resumed from it judges every step, the last one before it too.
        """
        checks = self._state()  # first: it reads and acts on a step waiting to be read late
        counters = {name: getattr(self, name) for name in (*_COUNTERS, "skipping")}
        if self._rollback is not None:
            counters["resume_at"] = self._rollback.resume_at
        last = {"last_rollback": list(self.last_rollback)} if self.last_rollback is not None else {}
        return {**counters, **last, **checks, **self._watch.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        for name in _COUNTERS:
            setattr(self, name, int(state_dict[name]))
        last = state_dict.get("last_rollback")
        self.last_rollback = (int(last[0]), int(last[1])) if last is not None else None
        if self._rollback is not None:
            self._rollback.skipping = int(state_dict["skipping"])
            self._rollback.resume_at = int(state_dict.get("resume_at", 0))
        self._watch.load_state_dict(state_dict)
        self._load_state(state_dict)

