"""The gradient check GradientMonitor and GradientAnomalyStopping share: its lifecycle and its step.

:class:`GradientCheck` holds what lives across steps (the detector, the NaN trace and its
hooks, the step's micro-batches, the parameter names) and runs the check in
``on_before_optimizer_step``. The parts of a checked step are each in a module of their own:
what is measured on device (``_step_measure``), how the ranks agree on it in one collective and
one host transfer (``_rank_agreement``), and the report of an anomalous step (``_anomaly_report``).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Optional, Union

import lightning.pytorch as pl
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hooks.callbacks._anomaly_report import AnomalyReport, report_step
from lightning_hooks.callbacks._base import HookCallback, Moment, acting_late, claim, moment
from lightning_hooks.callbacks._flight_recorder import FlightRecord
from lightning_hooks.core._compat import BarCount, callbacks_of
from lightning_hooks.core._validation import check_bool, check_path, check_writable_dir
from lightning_hooks.core.selection import ModuleSelection, named_parameters
from lightning_hooks.distributed._rank_agreement import Check
from lightning_hooks.distributed._shared_measurement import SharedMeasurement
from lightning_hooks.distributed._step_measure import Step
from lightning_hooks.measure._provenance import NonFiniteTrace
from lightning_hooks.measure._sharding import note_flat_shards
from lightning_hooks.measure.anomalies import AnomalyDetector

#: The arguments of the check both gradient callbacks take, as their constructors name them.
DETECTOR_ARGS = ("check_finite", "norm_threshold", "relative_threshold", "min_norm", "window", "provenance", "dirpath")


def overruled(monitor: GradientCheck, reporter: GradientCheck) -> Optional[str]:
    """Why ``monitor``'s detector arguments do not reach the report ``reporter`` writes for both; None when they do.

    Only the arguments given to ``monitor`` (not left at its defaults) that ``reporter`` does not share count.
    """
    defaults = _defaults(type(monitor))
    given = [name for name in DETECTOR_ARGS
             if getattr(monitor, name) != defaults.get(name, ...) and getattr(monitor, name) != getattr(reporter, name)]
    if not given:
        return None
    mine = ", ".join(f"{name}={getattr(monitor, name)!r}" for name in given)
    theirs = ", ".join(f"{name}={getattr(reporter, name)!r}" for name in given)
    return (f"{type(monitor).__name__}({mine}) and {type(reporter).__name__}({theirs}) are in one Trainer: only"
            f" {type(reporter).__name__} writes the anomaly report (`anomalies/report`, `last_report`), by its own"
            f" settings, so a step only {type(monitor).__name__} flags gets no report, and the report's provenance"
            f" and saved step follow {type(reporter).__name__}'s. Pass the same values to"
            f" {type(reporter).__name__}, or leave them out of {type(monitor).__name__} (its flags and figures"
            " follow its own settings either way).")


def _defaults(kind: type) -> dict[str, Any]:
    """The defaults of the detector arguments, from the first constructor in ``kind``'s MRO that gives them all.

    A subclass whose own constructor takes other arguments (``**kwargs``) inherits its base's. None found:
    every argument counts as given.
    """
    for cls in kind.__mro__:
        params = inspect.signature(cls).parameters
        if all(name in params and params[name].default is not inspect.Parameter.empty for name in DETECTOR_ARGS):
            return {name: params[name].default for name in DETECTOR_ARGS}
    return {}


class GradientCheck(HookCallback):
    """The step check both gradient callbacks run in ``on_before_optimizer_step``.

    Measures the gradients and flags anomalies on device, agrees on the flags across ranks on
    device, reads the step's figures in one host transfer (two on a step with an infinite
    gradient norm, see :meth:`on_before_optimizer_step`), keeps the running median, traces NaN
    provenance and writes reports. Subclasses act on the result in :meth:`_handle`.
    """

    # Provenance watches every step: its hooks stay on for the whole fit.
    _hooks_follow_gate = False

    def __init__(
        self, modules: ModuleSelection, check_finite: bool, norm_threshold: Optional[float],
        relative_threshold: Optional[float], min_norm: Optional[float], window: int,
        provenance: bool, dirpath: Optional[Union[str, os.PathLike]],
    ) -> None:
        super().__init__(modules)
        self._detector = AnomalyDetector(check_finite, norm_threshold, relative_threshold, min_norm, window)
        check_bool("provenance", provenance)
        check_path("dirpath", dirpath, optional=True)
        self.check_finite, self.norm_threshold, self.min_norm = check_finite, norm_threshold, min_norm
        self.relative_threshold, self.window = relative_threshold, window
        self.provenance, self.dirpath = provenance, dirpath
        self._trace = NonFiniteTrace()
        self._micro_batches: list[tuple[int, Any]] = []  # (batch_idx, batch if saved) of this step
        self._stepped = False  # whether an optimizer step ran in the current batch
        self._evaluation = 0  # which evaluation of the step's closure this is, from 1 (LBFGS runs several)
        self._param_names: dict[Tensor, str] = {}
        self._traced: list[Tensor] = []  # parameters whose gradients the trace checks
        self._shown: Optional[int] = None  # the value the progress bar shows
        self._bar = BarCount()  # carries it as an int
        self._at_end = False  # acting late at the end of training: no update follows, Lightning takes no `log`
        self._state_key: Optional[str] = None
        self._shared: Optional[SharedMeasurement] = None  # the fit's one measurement per step, joined
        self._measurement: Optional[SharedMeasurement] = None  # made here for the fit where this is the first

    def _uses_modules(self) -> bool:
        return self.provenance

    def _key(self) -> dict[str, Any]:
        """What tells two instances apart in a checkpoint, for ``state_key``."""
        return dict(check_finite=self.check_finite, norm_threshold=self.norm_threshold,
                    relative_threshold=self.relative_threshold, min_norm=self.min_norm)

    @property
    def state_key(self) -> str:
        """Identifies this instance's state in a checkpoint, so several can be used together.

        Made once: Lightning reads it at every hook call, for its profiler's labels.
        """
        if self._state_key is None:
            self._state_key = self._generate_state_key(**self._key())
        return self._state_key

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the module selection when it is used; check that ``dirpath`` can be written, before training.

        Raises:
            ValueError: If ``dirpath`` cannot be created or written to (read-only, no permission).
        """
        claim(self, trainer)
        if stage == "fit" and self._lead(trainer) is self:  # before any on_fit_start: every reader finds it there
            self._measurement = SharedMeasurement()
        if self.dirpath is not None:
            check_writable_dir("dirpath", self.dirpath)
        if self._uses_modules():
            super().setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the hooks; read the fit's shared measurement of each step from now on."""
        super().on_fit_start(trainer, pl_module)
        self._join(trainer)

    def _lead(self, trainer: pl.Trainer) -> GradientCheck:
        """The first gradient check in ``trainer.callbacks`` (this one outside them): it holds the fit's measurement."""
        return next(iter(callbacks_of(trainer, GradientCheck)), self)

    def _join(self, trainer: pl.Trainer) -> SharedMeasurement:
        """Read the fit's one measurement of each step from now on: the one its lead made in ``setup``."""
        lead = self._lead(trainer)
        if lead._measurement is None:  # its ``setup`` did not run for a fit
            lead._measurement = SharedMeasurement()
        self._shared = lead._measurement
        self._shared.join(self)
        return self._shared

    def attach(self, model: nn.Module) -> None:
        """Learn the parameter names; register the provenance hooks when asked for."""
        if self._uses_modules():
            super().attach(model)
        else:
            self.detach()
        self._param_names = {p: name for name, p in named_parameters(model)}
        note_flat_shards(model, type(self).__name__)
        if not self.provenance:
            return
        self._traced = [p for p in self._param_names if p.requires_grad]
        for index, param in enumerate(self._traced, start=len(self._targets)):
            hook = self._guard(self._param_names[param], self._trace.grad_hook(index))
            self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def _register(self, index: int, name: str, module: nn.Module) -> list[RemovableHandle]:
        if not self.provenance:
            return []
        return [module.register_forward_hook(self._guard(name, self._trace.output_hook(index)))]

    def _show(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str, value: int) -> None:
        """Show ``value`` in the progress bar if there is one and it changed (the bar keeps it), as an int.

        Not before it is first non-zero: a healthy run's bar carries no count. A ``log`` call
        costs a good part of a millisecond, and on an accelerator a host-to-device copy.
        """
        if value == self._shown or not (value or self._shown is not None) or self._at_end:
            return  # the usual case, nothing new to show: no look for the bar among the callbacks
        if trainer.progress_bar_callback is not None:
            self._bar(value)
            pl_module.log(name, self._bar, prog_bar=True, logger=False, on_step=True, on_epoch=False,
                          metric_attribute=name)
            self._shown = value

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Note the micro-batch (and keep the batch, to save it) until its optimizer step."""
        if len(self._micro_batches) >= trainer.accumulate_grad_batches:  # no step came (manual optimization)
            self._new_step()
        if self.provenance:  # the trace's micro-batches, and its hooks' gate: with provenance alone
            self._trace.mark()
            self._collecting = True
        self._micro_batches.append((batch_idx, batch if self.dirpath is not None else None))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Close the gate; drop the step's batches once its optimizer step is done."""
        if self._gate or self._gated:  # open with provenance alone
            self._collecting = False
        if self._stepped:
            self._new_step()

    def _new_step(self) -> None:
        self._trace.clear()
        self._micro_batches.clear()
        self._stepped = False

    def detach(self) -> None:
        """Remove the hooks, drop every reference into the model and the step, forget the progress bar.

        Lightning clears the progress bar's values for each fit.
        """
        super().detach()
        self._new_step()
        self._collecting, self._param_names, self._traced, self._shown = False, {}, [], None
        self._evaluation = 0
        if self._shared is not None:
            self._shared.leave(self)
            self._shared = None

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        """Check the step's gradients: after accumulation, after AMP unscaling.

        The step is measured once for every gradient callback of the Trainer (see
        :class:`~lightning_hooks.distributed._shared_measurement.SharedMeasurement`); this one acts on its part.

        An optimizer that evaluates its closure several times in one step (LBFGS) brings
        Lightning here at every evaluation, at the same global step: :attr:`_evaluation` counts
        them, and only the first (the gradient at the step's starting parameters) joins the
        running median; :meth:`_checks` says which evaluations are checked at all.
        """
        shared = self._shared if self._shared is not None else self._join(trainer)
        read = shared.read(trainer, optimizer, self)
        self._evaluation = shared.evaluation
        if read is not None:
            self._handle(trainer, pl_module, optimizer, *read)
        self._trace.clear()
        self._stepped = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Act on the last step if its check was left to be read a step late."""
        if self._shared is not None:
            self._shared.finish(at_end=True)

    def _may_wait(self, trainer: pl.Trainer) -> bool:
        """Whether this step's check can be read and acted on a step late, without a blocking read now.

        Not with ``provenance`` or ``dirpath``: the NaN trace and the step's batches are gone by then.
        """
        return not self.provenance and self.dirpath is None

    def _moment(self, trainer: pl.Trainer) -> tuple[Moment, list[tuple[int, Any]]]:
        return moment(trainer), list(self._micro_batches)

    def _late(self, trainer: pl.Trainer, optimizer: Any, step: Step, check: Check,
              at: tuple[Moment, list[tuple[int, Any]]], at_end: bool) -> None:
        """Act on a step read a step late, as at that step: its log step, global step, epoch and batches.

        What drops an update (``stop``) drops the update about to be made: the step's own is applied.
        At the end of training the progress bar is left as it is (Lightning takes no ``self.log`` there).
        """
        when, batches = at
        current, self._micro_batches, self._evaluation = self._micro_batches, batches, 1
        self._at_end = at_end
        try:
            with acting_late(trainer, when):
                self._handle(trainer, trainer.lightning_module, optimizer, step, check)
        finally:
            self._micro_batches, self._at_end = current, False

    def _checks(self, trainer: pl.Trainer, evaluation: int) -> bool:
        """Whether this callback checks evaluation ``evaluation`` (from 1) of the current step's closure."""
        return True

    def _extra(self, trainer: pl.Trainer, step: Step) -> dict[str, Tensor]:
        """More device figures to bring to the host in the step's one transfer, by name."""
        return {}

    def _votes(self, trainer: pl.Trainer, step: Step) -> dict[str, Tensor]:
        """Device figures to sum over the ranks in the step's one collective, by name (asked before ``_extra``)."""
        return {}

    def _handle(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, step: Step,
                check: Check) -> None:
        raise NotImplementedError

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: Step,
                check: Check, flight_record: Optional[FlightRecord] = None) -> AnomalyReport:
        """Build, save and log the report; under several ranks every rank must call this."""
        n_outputs = len(self._targets)
        located = self._trace.locate(trainer, n_outputs, n_outputs + len(self._traced)) if self.provenance else None
        names = [self._param_names.get(p, f"param{i}") for i, p in enumerate(step.params)]
        return report_step(trainer, pl_module, step, check, names=names, located=located, traced=self._traced,
                           module_names=self.module_names, micro_batches=self._micro_batches,
                           dirpath=None if self.dirpath is None else os.fspath(self.dirpath),
                           flight_record=flight_record)

    def _state(self) -> dict[str, Any]:
        if self._shared is not None:  # a step waiting to be read late is judged before its state is saved
            self._shared.finish(at_end=True)
        return {"detector": self._detector.state_dict()}

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        self._detector.load_state_dict(state_dict["detector"])
