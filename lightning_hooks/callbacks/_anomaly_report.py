"""The anomaly report: what went wrong at a step and where it began; built, saved for replay, logged.

:class:`AnomalyReport` is what GradientMonitor and GradientAnomalyStopping hand to the user
(logged as text, kept in ``last_report``, carried by ``GradientAnomalyError``).
:func:`report_step` makes one from a step's figures and the NaN trace's finding, saves the
step's batches and model state when asked, and logs the report as ``anomalies/report``.
"""

from __future__ import annotations

import math
import os
import textwrap
import warnings
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor

from lightning_hooks.callbacks._base import log_step, moment
from lightning_hooks.callbacks._flight_recorder import FlightRecord, discard_file
from lightning_hooks.core._compat import callbacks_of
from lightning_hooks.measure._provenance import NEVER, Located
from lightning_hooks.output.figures import Diagnoses
from lightning_hooks.output.sinks import log_text

if TYPE_CHECKING:  # for types only: both import anomalies, which imports this module
    from lightning_hooks.distributed._rank_agreement import Check
    from lightning_hooks.distributed._step_measure import Step


@dataclass(frozen=True)
class AnomalyReport:
    """What went wrong at one optimizer step, and where it began.

    Attributes:
        step: ``trainer.global_step`` of the optimizer step (steps completed before it).
        epoch: The epoch.
        batch_idx: Index in the epoch of the step's batch: with gradient accumulation and
            provenance, the micro-batch in which non-finite values showed first, else the
            step's last one.
        flags: The flags that fired: ``"nonfinite"`` for all gradients together, and with
            several parameter groups ``"nonfinite/group1"`` for group 1, and so on.
        total_norm: L2 norm of all gradients.
        group_norms: L2 norm per parameter group.
        first_nonfinite_module: The first watched module, in forward execution order, whose
            output held a NaN or an Inf this step; None if none did or provenance was off.
        nonfinite_rank: Under several processes, the rank where non-finite values showed
            first (in a module output, else in a gradient); the report's provenance is that
            rank's.
        nonfinite_params: Parameters whose gradients hold a NaN or an Inf. With provenance,
            in the order backward made them non-finite, first bad first (those that were
            finite on that rank, so only went bad in the all-reduce, come last); else in the
            optimizer's order.
        largest_norms: The parameters with the largest gradient norms, largest first.
        saved_path: Where the step's batch and model state were saved for replay, if they were:
            a ``torch.save`` of ``{"report", "batch", "batches", "state_dict"}``, where ``batch``
            is the micro-batch of ``batch_idx`` and ``batches`` all of the step's micro-batches.
        diagnosis: With a TransformerStability or a LayerHealth in ``callbacks``, the first's
            diagnosis from the figures logged so far: which layers are outside a band, since
            when, and what usually helps; None without either.
        flight_record: The last steps' loss and per-layer gradient norms, and which layer's norm
            left its usual range first (``GradientAnomalyStopping(flight_recorder=N)``); else None.

    """

    step: int
    epoch: int
    batch_idx: Optional[int]
    flags: tuple[str, ...]
    total_norm: float
    group_norms: tuple[float, ...]
    first_nonfinite_module: Optional[str] = None
    nonfinite_rank: Optional[int] = None
    nonfinite_params: tuple[str, ...] = ()
    largest_norms: tuple[tuple[str, float], ...] = ()
    saved_path: Optional[str] = None
    diagnosis: Optional[str] = None
    flight_record: Optional[FlightRecord] = None

    def __str__(self) -> str:
        groups = ", ".join(f"{n:.4g}" for n in self.group_norms)
        lines = [
            f"Gradient anomaly at step {self.step} (epoch {self.epoch}, batch {self.batch_idx}):"
            f" {', '.join(self.flags)}",
            f"  total gradient norm {self.total_norm:.4g}"
            + (f" (per parameter group: {groups})" if len(self.group_norms) > 1 else ""),
        ]
        if self.first_nonfinite_module is not None:
            rank = f" on rank {self.nonfinite_rank}" if self.nonfinite_rank is not None else ""
            lines.append(f"  first non-finite output: module {self.first_nonfinite_module!r}{rank}")
        if self.nonfinite_params:
            bad = self.nonfinite_params
            more = f", ... ({len(bad) - 8} more)" if len(bad) > 8 else ""
            lines.append(f"  non-finite gradients in {len(bad)} parameter(s): {', '.join(bad[:8])}{more}")
        if self.largest_norms:
            largest = ", ".join(f"{name} {norm:.4g}" for name, norm in self.largest_norms)
            lines.append(f"  largest gradient norms: {largest}")
        if self.saved_path is not None:
            lines.append(f"  batch and model state saved to {self.saved_path}")
        if self.diagnosis is not None:
            lines.extend(["  diagnosis so far:", *("    " + line for line in self.diagnosis.splitlines())])
        if self.flight_record is not None:
            lines.append("  " + self.flight_record.summary())
        return "\n".join(_wrapped(line) for line in lines)


def _wrapped(line: str, width: int = 100) -> str:
    """``line`` folded at ``width`` between words, its continuations indented under it.

    So that no line of a report runs off a console or TensorBoard's Text tab; names and paths are
    never broken.
    """
    if len(line) <= width:
        return line
    indent = " " * (len(line) - len(line.lstrip(" ")) + 4)
    return textwrap.fill(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _diagnosis_so_far(trainer: Any) -> Optional[str]:
    """The diagnosis of the first callback of ``trainer`` that diagnoses (:class:`Diagnoses`) and has judged a step.

    None when none has judged a step yet, or on a rank other than zero (they judge on rank zero).
    """
    if not getattr(trainer, "is_global_zero", True):
        return None
    judged = [c for c in callbacks_of(trainer, Diagnoses) if c.verdicts.last_step is not None]
    return judged[0].diagnosis() if judged else None


def report_step(
    trainer: pl.Trainer, pl_module: pl.LightningModule, step: Step, check: Check, *, names: list[str],
    located: Optional[Located], traced: list[Tensor], module_names: list[str],
    micro_batches: list[tuple[int, Any]], dirpath: Optional[str], flight_record: Optional[FlightRecord] = None,
) -> AnomalyReport:
    """Build the report of an anomalous step, save the step when asked, and log the report as text.

    Args:
        trainer: The trainer, for the step, the epoch, the rank and the loggers.
        pl_module: The module whose state is saved with the step.
        step: The step's figures on device.
        check: The step's figures on the host, agreed across ranks.
        names: The name of each of ``step.params``.
        located: Where non-finite values showed first; None without provenance.
        traced: The parameters the trace watched, after the ``module_names`` outputs in its indices.
        module_names: The watched modules, in the trace's order.
        micro_batches: The step's ``(batch_idx, batch)`` pairs (batch None when not kept).
        dirpath: Where to save the step for replay; None to save nothing.
        flight_record: The flight record of the steps up to this one, if one is kept.

    Returns:
        The report, with ``saved_path`` set when the step was saved.
    """
    n_outputs = len(module_names)
    norms, bad_grads = torch.stack([step.figures.norms, step.figures.bad.double()]).cpu().tolist()
    largest = sorted(((n, v) for n, v in zip(names, norms) if math.isfinite(v)), key=lambda item: -item[1])
    # First bad first: in the order backward made them non-finite; the rest in optimizer order.
    went_bad = {p: located.first[i] for i, p in enumerate(traced, n_outputs)} if located else {}
    bad = sorted((i for i, is_bad in enumerate(bad_grads) if is_bad),
                 key=lambda i: went_bad.get(step.params[i], NEVER))
    module = located.earliest(range(n_outputs)) if located else None
    micro = located.micro_batch if located and located.micro_batch is not None else -1
    batch_idx, batch = micro_batches[micro] if micro_batches else (None, None)
    report = AnomalyReport(
        step=moment(trainer).global_step, epoch=moment(trainer).epoch, batch_idx=batch_idx,  # read late: its step
        flags=tuple(name for name, fired in check.flags.items() if fired),
        total_norm=check.norms[-1], group_norms=tuple(check.norms[:-1]),
        first_nonfinite_module=None if module is None else module_names[module],
        nonfinite_rank=located.rank if located else None,
        nonfinite_params=tuple(names[i] for i in bad),
        largest_norms=tuple(largest[:5]),
        diagnosis=_diagnosis_so_far(trainer),
        flight_record=flight_record,
    )
    if dirpath is not None:
        report = replace(report, saved_path=_save(dirpath, trainer, pl_module, report, batch, micro_batches))
    text = "\n".join("    " + line for line in str(report).splitlines())  # markdown code block
    log_text(trainer, "anomalies/report", text, log_step(trainer))
    return report


def _save(dirpath: str, trainer: pl.Trainer, pl_module: pl.LightningModule, report: AnomalyReport,
          batch: Any, micro_batches: list[tuple[int, Any]]) -> Optional[str]:
    """Save the step for replay; return its path.

    None, with a warning, when it cannot be saved (a full disk, a batch that does not pickle):
    the report is still kept, logged and acted on.
    """
    path = os.path.join(dirpath, f"anomaly-step{report.step}-rank{trainer.global_rank}.pt")
    payload = {"report": asdict(report), "batch": batch, "batches": [b for _, b in micro_batches],
               "state_dict": pl_module.state_dict()}
    try:
        os.makedirs(dirpath, exist_ok=True)
        torch.save(move_data_to_device(payload, "cpu"), path)
    except Exception as err:  # a side write must never end the run, nor lose the report
        discard_file(path)
        warnings.warn(f"the batch and model state of anomalous step {report.step} could not be saved to {path}"
                      f" ({type(err).__name__}: {err}); the report is kept (`last_report`, the loggers'"
                      " anomalies/report), the action goes ahead and training goes on.", stacklevel=2)
        return None
    return path
