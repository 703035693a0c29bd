"""GradientMonitor: gradient norms and histograms, and anomaly flags at every optimizer step.

Here is what the monitor decides: its settings, when a step is logged, which flags and reports go
out. The check it shares with GradientAnomalyStopping is in ``_gradient_check``; its rows are in ``_gradient_rows``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_hooks.callbacks._anomaly_report import AnomalyReport
from lightning_hooks.callbacks._base import _log_interval, _validate_interval, _validate_stats, log_step
from lightning_hooks.callbacks._gradient_check import GradientCheck, overruled
from lightning_hooks.callbacks._gradient_rows import GradientRows, selection_key
from lightning_hooks.callbacks._judged_rows import judged_apart
from lightning_hooks.callbacks._update_ratio import UpdateRatio
from lightning_hooks.callbacks.stopping import GradientAnomalyStopping
from lightning_hooks.core._compat import callbacks_of
from lightning_hooks.core._validation import check_bool, check_choice
from lightning_hooks.core.selection import ModuleSelection, validate_limit
from lightning_hooks.distributed._rank_agreement import Check
from lightning_hooks.distributed._step_measure import Step
from lightning_hooks.measure.stats import STAT_NAMES, Bins, binning
from lightning_hooks.output._health_verdicts import UNJUDGED_RATIOS_TAG
from lightning_hooks.output.figures import ScalarBlock
from lightning_hooks.output.sinks import destinations, log_layout, log_plugin_data, log_scalars

Granularity = Literal["parameter", "module"]

#: Statistics GradientMonitor can log per parameter or module: the L2 norm, and those of stat rows.
GRADIENT_STAT_NAMES = ("norm", *STAT_NAMES)


class GradientMonitor(GradientCheck):
    """Log gradient norms and histograms, and flag gradient anomalies at every optimizer step.

    Everything happens in ``on_before_optimizer_step``, after gradient accumulation and AMP unscaling
    (a ``fused=True`` optimizer is unscaled here, as for gradient clipping): the figures are of the
    gradients the optimizer applies. Under DDP they are averaged already, not reduced again; rank zero writes.

    On logged steps (as Lightning logs: the loop's step ``n`` with ``(n + 1) % log_every_n_steps
    == 0``, and step 0, at the step ``self.log`` writes at) it logs ``gradients/<name>/norm`` per
    parameter (``granularity="parameter"``) or per module (``"module"``), ``gradients/total_norm``
    (as ``torch.nn.utils.get_total_norm``, in float64 sums on the CPU; ``gradients/total_norm/group<i>`` per
    parameter group when there are several), any other ``stats``, and ``gradients/<name>`` histograms to a
    TensorBoardLogger or WandbLogger, non-finite values left out and counted. Each TensorBoardLogger
    gets a Custom Scalars layout once: a chart per stat of every row, the total norms, the flags.

    With ``update_ratio=True`` it also logs, per row, ``updates/<name>/ratio``, the
    update-to-weight ratio ``||w_after - w_before|| / ||w_before||`` of the logged step's
    update (healthy is around 1e-3), and ``updates/<name>/log10_ratio``: the row's parameters
    are cloned on their device just before the update (on logged steps only: other steps hold
    no copy and do no work) and compared in an optimizer step post-hook, in one host transfer
    of their own. A step the AMP GradScaler skips, and an update ``GradientAnomalyStopping``
    drops, give no ratio; with gradient accumulation only the real optimizer step is measured.
    A row that was all zeros before the step (a bias or LayerNorm shift at initialisation) has
    no ratio at that step (``||w_before|| = 0``: it would be infinite), so none is logged for it
    there; it gets one from its next logged step on.

    At every optimizer step it computes the anomaly flags (``nonfinite``, ``exploding``,
    ``vanishing``: those the arguments enable; ``amp_overflow`` under a GradScaler, whose skipped
    steps are never flagged otherwise) and logs them as 0/1 scalars, ``anomalies/<flag>`` and per
    parameter group ``anomalies/<flag>/group<i>``, on logged steps, on steps that raise one and on
    the step after; the count of anomalous steps shows in the progress bar (``anomalies``). The
    first step of a run of anomalous steps, and any step raising a new flag, gets an
    :class:`~lightning_hooks.AnomalyReport` (text ``anomalies/report``, :attr:`last_report`);
    beside a ``GradientAnomalyStopping`` the stopper writes the one report of a step. With no flag
    enabled and no ``provenance``, the steps it does not log are not measured at all.

    A step is measured once for every gradient callback of the Trainer, batched on device, and
    reaches the host in one transfer: on a step not logged it is read at the next step, its flags
    logged at their own step, unless a callback beside it needs it before the update (``skip``,
    ``rollback``) or ``provenance`` or ``dirpath`` is set. Several optimizers, LBFGS, several
    instances, and what a step not logged costs: docs/gradient_monitor.md and docs/cost.md.

    Args:
        modules: The modules whose parameters get rows (None: every parameter, or with
            ``"module"`` every module whose parameters are all its own: see
            ``is_default_module``); also the modules whose outputs ``provenance`` watches. Rows
            follow what the optimizers train: a parameter in no param group has none until one
            is added (``BackboneFinetuning``), and a selection with nothing trained warns at fit
            start. The only argument taken by position; the
            others are keyword-only.
        log_every_n_steps: Log norms and histograms every this many optimizer steps. None: the
            Trainer's ``log_every_n_steps``.
        granularity: One row per ``"parameter"`` or per selected ``"module"``.
        stats: Which figures to log per row, from :data:`GRADIENT_STAT_NAMES`.
        histogram: Whether to write gradient histograms to TensorBoard and W&B.
        bins: Histogram bins, see :func:`lightning_hooks.measure.stats.histogram_edges`.
        check_finite: Flag gradients that hold a NaN or an Inf.
        norm_threshold: Flag a group or total norm above this as exploding (it only flags; to clip,
            use the Trainer's ``gradient_clip_val``).
        relative_threshold: Flag a norm above this multiple of its running median as exploding.
        min_norm: Flag a group or total norm below this as vanishing.
        window: How many clean steps the running median covers.
        provenance: Watch module outputs and gradients for NaN/Inf (a cheap on-device check per
            module call and per parameter per backward), to report the first module in forward
            order whose output was non-finite, and the parameters whose gradients went non-finite.
        dirpath: Save the batch and the model state of each reported step here, for replay.
        prog_bar: Show the count of anomalous steps in the progress bar.
        max_rows: The most rows to log (None: no limit): a very large model fails before training
            with a hint instead of logging thousands of tags a step.
        update_ratio: Log each row's update-to-weight ratio on logged steps (costs, on those
            steps, a copy of the rows' parameters on their device until the update is made).
        update_norms: With ``update_ratio``, also log each row's update norm ``||Δw||``
            (``updates/<name>/norm``) and, for optimizers keeping Adam's moments (``exp_avg``,
            ``exp_avg_sq``: Adam, AdamW, NAdam, RAdam, ...), ``updates/<name>/exp_avg_norm`` and
            ``updates/<name>/exp_avg_sq_sqrt_norm`` (``||sqrt(v)||``, read as ``sqrt(sum(v))``:
            no copy), in the ratios' one collective and one transfer.

    Raises:
        ValueError: For a bad ``log_every_n_steps``, ``granularity``, stat, ``bins``, threshold or
            ``max_rows``, or (before training) a module pattern matching nothing or over ``max_rows`` rows.
        TypeError: For an argument of the wrong type: a flag that is not a bool, a count that is not
            an int, a threshold that is not a number, a ``dirpath`` that is not a path.

    Example::

        from lightning import Trainer
        from lightning_hooks import GradientMonitor

        monitor = GradientMonitor(log_every_n_steps=50, norm_threshold=100.0, provenance=True)
        trainer = Trainer(callbacks=[monitor])

    """

    def __init__(
        self,
        modules: ModuleSelection = None,
        *,
        log_every_n_steps: Optional[int] = None,
        granularity: Granularity = "parameter",
        stats: Sequence[str] = ("norm",),
        histogram: bool = True,
        bins: Bins = 128,
        check_finite: bool = True,
        norm_threshold: Optional[float] = None,
        relative_threshold: Optional[float] = None,
        min_norm: Optional[float] = None,
        window: int = 50,
        provenance: bool = False,
        dirpath: Optional[Union[str, os.PathLike]] = None,
        prog_bar: bool = True,
        max_rows: Optional[int] = 1000,
        update_ratio: bool = False,
        update_norms: bool = False,
    ) -> None:
        super().__init__(modules, check_finite, norm_threshold, relative_threshold, min_norm, window,
                         provenance, dirpath)
        _validate_interval(log_every_n_steps)
        check_choice("granularity", granularity, ("parameter", "module"))
        _validate_stats(stats, GRADIENT_STAT_NAMES)
        binning(bins)  # validates `bins`, and computes the edges every block of these bins shares
        for name, flag in (("histogram", histogram), ("prog_bar", prog_bar), ("update_ratio", update_ratio),
                           ("update_norms", update_norms)):
            check_bool(name, flag)
        if update_norms and not update_ratio:
            raise ValueError("`update_norms=True` reads the snapshot `update_ratio` takes, got update_ratio=False:"
                             " pass update_ratio=True too")
        validate_limit("max_rows", max_rows)
        self.update_ratio, self.update_norms = update_ratio, update_norms
        self._updates = UpdateRatio(norms=update_norms)
        self._vectors: set[str] = set()  # 1-D parameters: their update ratios are not judged (LayerHealth, the tab)
        self._scales: set[str] = set()  # norms' scales: their update ratios judged apart
        self.log_every_n_steps, self.granularity, self.stats = log_every_n_steps, granularity, tuple(stats)
        self.histogram, self.bins, self.prog_bar, self.max_rows = histogram, bins, prog_bar, max_rows
        self._last_report: Optional[AnomalyReport] = None
        self._reporter: Optional[GradientAnomalyStopping] = None  # the stopper that reports for both, if any
        self._anomalies, self._every = 0, 1
        self._fired: frozenset[str] = frozenset()
        self._raised = False  # whether a flag was raised at the last step
        self._histograms = False  # whether histograms are written: asked for, and a logger that takes them
        self._written = True  # whether the figures are written anywhere: a logger, or a listener
        self._rows = GradientRows(type(self).__name__)
        self._logged = False  # whether this step's transfer holds the rows' figures

    @property
    def last_report(self) -> Optional[AnomalyReport]:
        """The report of the last reported step; with a GradientAnomalyStopping in the Trainer, the stopper's."""
        return self._reporter.last_report if self._reporter is not None else self._last_report

    @property
    def anomalous_steps(self) -> int:
        """How many optimizer steps were flagged so far."""
        return self._anomalies

    def _uses_modules(self) -> bool:
        return self.provenance or self.granularity == "module" or self.modules is not None

    def _key(self) -> dict[str, Any]:
        return {"granularity": self.granularity, "modules": selection_key(self.modules),
                "log_every_n_steps": self.log_every_n_steps, "stats": self.stats, **super()._key()}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve modules and the logging interval; leave the reports to a GradientAnomalyStopping beside it.

        Warns when detector arguments given to this monitor differ from that stopper's.
        """
        super().setup(trainer, pl_module, stage)
        self._reporter = next(iter(callbacks_of(trainer, GradientAnomalyStopping)), None)
        message = overruled(self, self._reporter) if self._reporter is not None else None
        if message is not None:
            rank_zero_warn(message)
        self._every = _log_interval(self.log_every_n_steps, trainer)
        # as LayerHealth reads them: before a strategy wraps the model
        self._vectors, self._scales = judged_apart(pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the hooks, choose the rows, allocate their buffers on the module's device, write the layout."""
        super().on_fit_start(trainer, pl_module)
        self._raised = False
        self._written, self._histograms = destinations(
            trainer, type(self).__name__, self.histogram, listened_histograms=False,
            skipped="it computes no norm, histogram or update ratio (the anomaly flags, reports and count still run)")
        self._choose_rows(trainer, pl_module, starting=True)
        log_layout(trainer, {"gradients": self._rows.charts()}, trainer.global_step)

    def _choose_rows(self, trainer: pl.Trainer, pl_module: pl.LightningModule, starting: bool) -> None:
        """Choose the rows (:meth:`GradientRows.choose`); with update ratios, name those LayerHealth does not judge."""
        self._rows.choose(trainer, pl_module, self, self._histograms, starting)
        if self.update_ratio:  # for the Layers tab: the rows whose ratio LayerHealth does not judge
            rows = set(self._rows.names)
            log_plugin_data(trainer, UNJUDGED_RATIOS_TAG, json.dumps(
                {"unjudged": sorted(self._vectors & rows), "scales": sorted(self._scales & rows)}), trainer.global_step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the step post-hooks that measure update ratios (after tuners may have replaced optimizers)."""
        if self.update_ratio:
            self._handles.extend(self._updates.register(trainer))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Drop a snapshot whose step never ran (a GradScaler skipped it), its memory unless the next step needs it."""
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._updates.discard(keep=self.update_ratio and self._written and self._is_logged_next(trainer, self._every))

    def detach(self) -> None:
        """Remove the hooks and drop the rows' references to parameters."""
        super().detach()
        self._rows.clear()
        self._updates.forget()

    def _checks(self, trainer: pl.Trainer, evaluation: int) -> bool:
        """Check the first evaluation of a step's closure only; with nothing to flag or trace, on logged steps only."""
        if evaluation != 1:  # one figure per optimizer step: LBFGS's later evaluations are not logged
            return False
        flags = bool(self._detector.enabled_flags)
        return flags or self.provenance or (self._written and self._is_logged(trainer, self._every))

    def _may_wait(self, trainer: pl.Trainer) -> bool:
        """A step not logged: its flags (and a report) can come a step late; a logged step's figures are read now."""
        return super()._may_wait(trainer) and not self._is_logged(trainer, self._every)

    def _extra(self, trainer: pl.Trainer, step: Step) -> dict[str, Tensor]:
        """Row norms, and the rows' stats and histograms, on logged steps."""
        self._logged = self._is_logged(trainer, self._every) and bool(step.params) and self._written
        if self._logged and self._rows.changed(trainer):  # a param group added
            self._choose_rows(trainer, trainer.lightning_module, starting=False)
        return self._rows.figures(step.params, step.figures.norms) if self._logged else {}

    def _handle(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any, step: Step,
                check: Check) -> None:
        raised = check.anomalous or bool(check.amp_overflow)  # a flag or the scaler's overflow: what is logged as 1
        # Flags go out on logged steps, and whenever one is raised or was at the step before (so
        # the plot comes back down where it did): no logger call, and no dict of them, on a quiet step.
        if self._logged or raised or self._raised:
            metrics = {f"anomalies/{name}": float(fired) for name, fired in check.flags.items()}
            if check.amp_overflow is not None:
                metrics["anomalies/amp_overflow"] = float(check.amp_overflow)
            figures: list[ScalarBlock] = []
            if self._logged:
                totals, figures = self._rows.metrics(trainer, check, self._histograms)
                metrics.update(totals)
            log_scalars(trainer, metrics, log_step(trainer), figures)
        self._raised = raised
        if self.update_ratio and self._logged and not check.amp_overflow:
            self._updates.take(self._rows.rows, optimizer, self._is_logged_next(trainer, self._every))
        if check.anomalous:
            fired = frozenset(name for name, on in check.flags.items() if on)
            if fired - self._fired and self._reporter is None:  # agreed flags: every rank reports, or none
                self._last_report = self._report(trainer, pl_module, step, check)
            self._anomalies, self._fired = self._anomalies + 1, fired
        elif not check.skipped:
            self._fired = frozenset()
        if self.prog_bar:
            self._show(trainer, pl_module, "anomalies", self._anomalies)

    def state_dict(self) -> dict[str, Any]:
        """Return the anomaly count and the running median windows."""
        checks = self._state()  # first: it reads a step waiting to be read late, which may add an anomaly
        return {"anomalies": self._anomalies, **checks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._anomalies = int(state_dict["anomalies"])
        self._load_state(state_dict)

