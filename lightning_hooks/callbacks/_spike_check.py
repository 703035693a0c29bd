"""GradientAnomalyStopping's spike trigger and flight recorder: the step's loss and gradient norms, on device.

The loss is what the LightningModule backpropagates: Lightning hands it to ``on_before_backward``
in automatic optimization (``training_step``'s loss, divided by ``accumulate_grad_batches``, so
the micro-batches of a step add up to their mean) and in manual optimization (each
``manual_backward``'s loss, added up until the optimizer steps). Under an AMP GradScaler the
hook sees the scaled loss; it is divided by the scale on device. Each rank judges its own loss
and the gradient norm against its own windows, before the step's one collective, and the flags
are summed over the ranks in it: any rank's spike is every rank's.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_hooks.callbacks._base import log_step
from lightning_hooks.callbacks._flight_leader import OutputLevels
from lightning_hooks.callbacks._flight_recorder import FlightRecord, FlightRecorder, write_record
from lightning_hooks.callbacks._update_norm import UpdateNorms
from lightning_hooks.core._validation import check_int
from lightning_hooks.distributed._rank_agreement import Check
from lightning_hooks.distributed._step_measure import Step
from lightning_hooks.measure.anomalies import AnomalyDetector
from lightning_hooks.measure.spikes import SPIKE_SIGNALS, SpikeTrigger, SpikeWindows


def validate_spikes(spikes: Any, flight_recorder: Any, watch_after: Any) -> None:
    """Check GradientAnomalyStopping's ``spikes``, ``flight_recorder`` and ``watch_after``.

    Raises:
        TypeError: If ``spikes`` is not a SpikeTrigger or None, or ``flight_recorder`` or
            ``watch_after`` is not an int.
        ValueError: If ``flight_recorder`` or ``watch_after`` is negative.
    """
    if spikes is not None and not isinstance(spikes, SpikeTrigger):
        raise TypeError(f"`spikes` must be a SpikeTrigger or None, got {spikes!r}: e.g. spikes=SpikeTrigger()")
    check_int("flight_recorder", flight_recorder, low=0)
    check_int("watch_after", watch_after, low=0)


class StepLoss:
    """The loss backpropagated since the last optimizer step, added up on device."""

    def __init__(self) -> None:
        self._sum: Optional[Tensor] = None

    def add(self, trainer: pl.Trainer, loss: Tensor) -> None:
        """Add a loss Lightning is about to backpropagate (unscaled first under an AMP GradScaler)."""
        loss = loss.detach().double().sum()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            loss = loss / scaler.scale(torch.ones((), device=loss.device)).double()  # the scale, with no sync
        self._sum = loss if self._sum is None else self._sum + loss

    def take(self, device: torch.device) -> Tensor:
        """The step's loss on ``device`` (NaN when none was backpropagated), and start the next step's."""
        taken, self._sum = self._sum, None
        if taken is None:
            return torch.full((), math.nan, dtype=torch.float64, device=device)
        return taken.to(device)

    def clear(self) -> None:
        """Forget what was added."""
        self._sum = None


class SpikeCheck:
    """Judges each step's loss and total gradient norm against their windows, and adds the agreed flags.

    Args:
        trigger: The thresholds and the windows' size.
    """

    def __init__(self, trigger: SpikeTrigger) -> None:
        self.trigger = trigger
        self.windows = SpikeWindows(trigger)
        self.signals = len(SPIKE_SIGNALS) if trigger.update_norm is not None else 2  # the update norm when watched
        self._judged: Optional[tuple[Tensor, int]] = None  # the values judged at this step, and the optimizer

    def votes(self, step: Step, loss: Optional[Tensor], update: Optional[Tensor] = None) -> dict[str, Tensor]:
        """The step's spike flags, to sum over the ranks; all zero at a later evaluation (``loss`` None).

        ``update`` is the step before's update norm (NaN: not made), judged when the trigger watches it.
        """
        norms = step.figures.group_norms
        if loss is None:
            self._judged = None
            return {"spikes": torch.zeros(self.signals, dtype=torch.float64, device=norms.device)}
        judged = [loss.to(norms), norms[-1]]
        if self.signals == len(SPIKE_SIGNALS):
            judged.append(update.to(norms) if update is not None else torch.full_like(norms[-1], math.nan))
        values = torch.stack(judged)
        _, flags = self.windows.judge(values, step.key)
        self._judged = (values, step.key)
        return {"spikes": flags.double()}

    def conclude(self, check: Check) -> Check:
        """``check`` with the spike flags agreed across ranks; the step's values join the windows.

        A step the AMP scaler skips (or where a rank had no gradient) says nothing: its values
        stay out of the windows and it is never a spike.
        """
        judged, self._judged = self._judged, None
        if judged is None or "spikes" not in check.votes or check.skipped:
            return check
        self.windows.remember(*judged)
        watched = (self.trigger.loss, self.trigger.grad_norm, self.trigger.update_norm)
        flags = {f"{signal}_spike": votes > 0 for signal, votes, threshold
                 in zip(SPIKE_SIGNALS, check.votes["spikes"], watched) if threshold is not None}
        return replace(check, flags={**check.flags, **flags}, anomalous=check.anomalous or any(flags.values()))


class SpikeWatch:
    """What GradientAnomalyStopping keeps of each step for ``spikes`` and ``flight_recorder``: all on device.

    Each optimizer has a flight recorder of its own (made at its first step), as it has spike
    windows of its own: their parameters differ.

    Args:
        spikes: The spike trigger, or None.
        flight_recorder: How many steps the flight recorder keeps (0: none).
    """

    def __init__(self, spikes: Optional[SpikeTrigger], flight_recorder: int) -> None:
        self.spikes = SpikeCheck(spikes) if spikes is not None else None
        self.flight_recorder = flight_recorder
        self.recorders: dict[int, FlightRecorder] = {}  # by optimizer, as the spike windows
        self.outputs = OutputLevels(flight_recorder)  # the modules' output std at the last logged steps (rank zero)
        self._loss = StepLoss()
        self._step_loss: Optional[Tensor] = None  # the loss of the step being checked
        #: Each step's update norm, measured only when the trigger watches it (a parameter copy per step).
        self.updates = UpdateNorms() if spikes is not None and spikes.update_norm is not None else None
        self._step_update: Optional[Tensor] = None  # the update norm of the step before the one being checked

    def add_loss(self, trainer: pl.Trainer, loss: Tensor) -> None:
        """Note a loss about to be backpropagated, if anything watches the loss."""
        if self.spikes is not None or self.flight_recorder:
            self._loss.add(trainer, loss)

    def votes(self, step: Step, first: bool) -> dict[str, Tensor]:
        """The step's spike flags, to sum over the ranks; the loss is the first evaluation's (LBFGS)."""
        if self.spikes is None and not self.flight_recorder:  # nothing reads the loss: no tensor made for it
            return {}
        device = step.figures.group_norms.device
        loss = self._loss.take(device)  # a later evaluation's loss is dropped
        self._step_loss = loss if first else None
        if first:
            self._step_update = self.updates.take(step.key, device) if self.updates is not None else None
        return self.spikes.votes(step, self._step_loss, self._step_update) if self.spikes is not None else {}

    def conclude(self, trainer: pl.Trainer, step: Step, check: Check) -> Check:
        """``check`` with the agreed spike flags; the step's figures kept by its optimizer's recorder."""
        if self.spikes is not None:
            check = self.spikes.conclude(check)
        if self.flight_recorder and self._step_loss is not None and not check.skipped:
            recorder = self.recorders.setdefault(step.key, FlightRecorder(self.flight_recorder,
                                                                                self.updates is not None))
            recorder.record(log_step(trainer), self._step_loss, step.figures.norms, self._step_update)
        return check

    def record(self, trainer: pl.Trainer, names: list[str], key: int) -> Optional[FlightRecord]:
        """Optimizer ``key``'s flight record up to this step, written out (every rank must call this).

        None without a recorder, or before that optimizer's first recorded step.
        """
        recorder = self.recorders.get(key)
        record = recorder.read(log_step(trainer), names, self.outputs) if recorder is not None else None
        return write_record(trainer, record) if record is not None else None

    def clear(self) -> None:
        """Forget the loss noted so far (at the end of ``fit``)."""
        self._loss.clear()
        self._step_loss = self._step_update = None
        if self.updates is not None:
            self.updates.forget()

    def copy_judges(self) -> dict[str, Any]:
        """A copy of what judges the steps (the spike windows, the flight recorders), on device, for a rollback."""
        return copy.deepcopy({"windows": self.spikes.windows if self.spikes is not None else None,
                              "recorders": self.recorders, "outputs": self.outputs})

    def restore_judges(self, judges: dict[str, Any]) -> None:
        """Put back a :meth:`copy_judges` (copied again: a later rollback to it finds it untouched)."""
        judges = copy.deepcopy(judges)
        if self.spikes is not None:
            self.spikes.windows = judges["windows"]
        self.recorders, self.outputs = judges["recorders"], judges["outputs"]

    def state_dict(self) -> dict[str, Any]:
        """The spike windows, if any."""
        return {"spikes": self.spikes.windows.state_dict()} if self.spikes is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the spike windows, if both the checkpoint and this instance have them."""
        if self.spikes is not None and "spikes" in state_dict:
            self.spikes.windows.load_state_dict(state_dict["spikes"])


class StepJudges:
    """What judges GradientAnomalyStopping's steps: the running medians, the spike windows, the flight recorders.

    A rollback copies them with its snapshot and puts them back with it (see
    :class:`~lightning_hooks.callbacks._rollback.Rollback`): copies on device, no host transfer.

    Args:
        detector: The gradient check's detector (its running medians).
        watch: The spike windows and flight recorders.
    """

    def __init__(self, detector: AnomalyDetector, watch: SpikeWatch) -> None:
        self.detector, self.watch = detector, watch

    def copy_judges(self) -> dict[str, Any]:
        """Copies of the running medians' windows, the spike windows and the flight recorders."""
        # The detector's own state_dict is for checkpoints (on the CPU); these copies stay on device.
        medians = {"history": {k: h.clone() for k, h in self.detector._history.items()},
                   "seen": dict(self.detector._seen)}
        return {"medians": medians, "watch": self.watch.copy_judges()}

    def restore_judges(self, judges: dict[str, Any]) -> None:
        """Put back what :meth:`copy_judges` returned (copied again: the snapshot stays untouched)."""
        self.detector.load_state_dict(judges["medians"])  # clones the windows, on their device
        self.watch.restore_judges(judges["watch"])
