"""A flight record: what it holds, and how people and the Layers tab read it (a summary, markdown, CSV, JSON)."""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

_MIN_ROWS = 8  # the fewest rows with which a usual range can be told (twice the baseline)
_GRADIENTS_ONLY = ("gradient norms alone cannot tell a cause from the layers its gradient flows back through:"
                   " log the outputs with ActivationMonitor, or read LayerHealth's verdict")


@dataclass(frozen=True)
class FlightRecord:
    """The loss and the per-layer gradient norms of the steps up to an anomaly, and which layer led.

    A layer is a module: the gradient norms of its parameters are combined (the root of the sum
    of their squares). A layer "left" its usual range at the earliest step from which its figure
    stayed out, to the anomaly, of the range of its figures before that step (the median and the
    spread of their logarithm: more than 3 robust standard deviations and a factor of 1.5 away,
    up or down), so a ramp does not widen its own range. Who led is judged from the modules'
    outputs where an ActivationMonitor logs them (the first module in forward order to leave,
    as LayerHealth's judge names a culprit), else from gradient norms (which cannot tell a
    cause from its effects: a tie is said as one). See ``callbacks/_flight_leader.py``.

    Attributes:
        step: The log step of the anomalous step (the last row): the loggers' step, as in TensorBoard.
        steps: The log step of each row, oldest first.
        losses: The loss of each row (rank zero's, as backpropagated); NaN where none was seen.
        layers: The layers, in the optimizer's order of their parameters.
        norms: Per row, the gradient norm of each layer.
        onsets: The layers whose gradient norm was out of range at the anomaly, with the step it
            left its range at, earliest first (ties: in the order of ``layers``).
        leader: The layer that left first (the first of a tie), or None.
        tied: The other layers that left at the same step as ``leader`` (gradient norms only:
            outputs are ordered by the forward pass).
        lead: How many steps before the anomaly ``leader`` left its range.
        rise: ``leader``'s figure (output std or gradient norm) at the anomaly over its usual one.
        usual: Per layer, its usual gradient norm range as ``(norm, factor)``: the median of its
            norm before it left its range (over the record's first half for a layer that did
            not), and how far (a factor, either way) the norm may stray from it before it is out
            of range; None for a layer without enough finite norms to tell.
        judged_by: ``"outputs"`` (the modules' output std, ActivationMonitor's logged steps),
            ``"output gradients"`` (no output out of range: the gradient reaching each module's
            output, ``gradients=True``) or ``"gradients"``: what ``leader`` was judged from.
        data: Every layer at once, judged from the outputs (the first module's, whose input is the
            batch, moved): the batch, not a layer.
        every: Every layer's gradient norm left its range at the same step (judged from gradient
            norms alone, which cannot tell the batch from a fault whose gradient reaches them all).
        output_onsets: The modules whose outputs were out of range at the anomaly, with the step
            they left it, in forward order (empty without output figures).
        update_norms: Per row, the norm of that step's update ``||w_after - w_before||`` (NaN
            where no update was measured or made: the anomalous step's is not made yet); empty
            unless the update norm is measured (``SpikeTrigger(update_norm=...)``).
        path: Where the record was written (CSV), if it was.

    """

    step: int
    steps: tuple[int, ...]
    losses: tuple[float, ...]
    layers: tuple[str, ...]
    norms: tuple[tuple[float, ...], ...]
    onsets: tuple[tuple[str, int], ...] = ()
    leader: Optional[str] = None
    lead: Optional[int] = None
    rise: Optional[float] = None
    usual: tuple[Optional[tuple[float, float]], ...] = ()
    tied: tuple[str, ...] = ()
    judged_by: str = "gradients"
    data: bool = False
    every: bool = False
    output_onsets: tuple[tuple[str, int], ...] = ()
    update_norms: tuple[float, ...] = ()
    path: Optional[str] = None

    def summary(self) -> str:
        """One line: which layer left its range first, how many steps before, and where the record is."""
        return record_summary(self) + (f"; written to {self.path}" if self.path else "")



def record_summary(record: FlightRecord) -> str:
    """One line: which layer left its range first, how many steps before (without where it was written)."""
    span = f"flight record of steps {record.steps[0]}-{record.steps[-1]}" if record.steps else "empty flight record"
    if len(record.steps) < _MIN_ROWS:
        return f"{span}: too few steps to tell a layer's usual gradient norm range"
    if record.leader is None:
        return f"{span}: no layer's outputs or gradient norm were out of their usual range at step {record.step}"
    start = record.step - (record.lead or 0)
    if record.judged_by == "outputs":
        if record.data:
            return (f"{span}: the first module's outputs ({record.leader!r}, its input is the batch) left their usual"
                    f" range at step {start}, {record.lead} steps before: every layer at once, look at the batch")
        after = [module for module, _ in record.output_onsets if module != record.leader]
        then = f"; the outputs of {len(after)} other modules left theirs too" if after else ""
        rise = record.rise if record.rise is not None else math.nan
        level = f"x{rise:.3g}" if 0 < rise < math.inf else "a NaN, an Inf or all zeros"
        return (f"{span}: layer {record.leader!r}'s outputs left their usual range first in forward order, at step"
                f" {start}, {record.lead} steps before ({level} at step {record.step}; its inputs in range){then}")
    if record.judged_by == "output gradients":
        return (f"{span}: the gradient reaching layer {record.leader!r}'s output left its usual range first in"
                f" backward order (net of the loss's own), at step {start}, {record.lead} steps before"
                f" (x{record.rise:.3g} at step {record.step}; the modules before it in forward order are its victims)")
    then = ", ".join(f"{layer!r} at step {at}" for layer, at in record.onsets[1 + len(record.tied):4])
    then = f"; then {then}" if then else ""
    if record.tied:
        names = ", ".join(repr(layer) for layer in (record.leader, *record.tied)[:8])
        more = f" and {len(record.tied) - 7} more" if len(record.tied) > 7 else ""
        every = "; every layer at once: the batch, or a fault whose gradient reaches them all" if record.every else ""
        return (f"{span}: a tie, {1 + len(record.tied)} layers left their usual gradient norm range at the same step"
                f" {start}, {record.lead} steps before, in forward order: {names}{more}{every} ({_GRADIENTS_ONLY})"
                f"{then}")
    return (f"{span}: layer {record.leader!r} left its usual gradient norm range first, {record.lead} steps before"
            f" (at step {start}; x{record.rise:.3g} at step {record.step}; {_GRADIENTS_ONLY}){then}")


def write_csv(folder: str, path: str, record: FlightRecord) -> None:
    """The record's rows as CSV: step, loss, the update norm (when measured), each layer's gradient norm."""
    os.makedirs(folder, exist_ok=True)
    updates = bool(record.update_norms)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss", *(["update_norm"] if updates else []),
                         *(f"grad_norm/{layer}" for layer in record.layers)])
        for i, (step, loss, row) in enumerate(zip(record.steps, record.losses, record.norms)):
            update = [f"{record.update_norms[i]:.6g}"] if updates else []
            writer.writerow([step, f"{loss:.6g}", *update, *(f"{v:.6g}" for v in row)])


def record_markdown(record: FlightRecord) -> str:
    """The record as the Text tab shows it (markdown): the summary, then the layers by when they left their range."""
    lines = [record.summary().replace("_", "\\_")]
    if record.output_onsets:
        lines += ["", "| module (forward order) | its outputs left their range at step | steps before the anomaly |",
                  "|---|---:|---:|"]
        lines += [f"| {_escaped(module)} | {at} | {record.step - at} |" for module, at in record.output_onsets]
    if record.onsets:
        usual = dict(zip(record.layers, record.usual))
        last = dict(zip(record.layers, record.norms[-1])) if record.norms else {}
        head = "| layer | left its range at step | steps before the anomaly | usual norm | norm at the anomaly |"
        lines += ["", head]
        lines.append("|---|---:|---:|---:|---:|")
        for layer, at in record.onsets:
            level = usual.get(layer)
            name, typical = _escaped(layer), "" if level is None else f"{level[0]:.4g}"
            lines.append(f"| {name} | {at} | {record.step - at} | {typical} | {last.get(layer, math.nan):.4g} |")
    return "\n".join(lines)


def _escaped(name: str) -> str:
    return name.replace("_", "\\_")


def _number(value: float) -> Union[float, str]:
    """A float as JSON can carry it: six significant digits, or ``"NaN"``/``"Infinity"``/``"-Infinity"``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(f"{value:.6g}")


def record_json(record: FlightRecord) -> dict[str, Any]:
    """The record as the Layers tab reads it (``anomalies/flight_record_data``, one JSON object).

    Keys: ``step`` (the anomalous log step), ``steps``, ``losses`` (one per row), ``layers``,
    ``norms`` (per row, one per layer), ``usual`` (per layer ``[norm, factor]`` or null: see
    :attr:`FlightRecord.usual`), ``onsets`` (``[layer, step]``, earliest first), ``leader``,
    ``lead``, ``tied`` (the layers that left at the leader's step), ``judged_by`` (``"outputs"``,
    ``"output gradients"`` or ``"gradients"``), ``data`` (every layer at once, from the outputs), ``every`` (every
    gradient norm at once), ``output_onsets`` (``[module, step]``, forward order) and
    ``update_norms`` (one per row, or empty). Non-finite numbers are the strings ``"NaN"``,
    ``"Infinity"``, ``"-Infinity"``.
    """
    return {
        "step": record.step, "steps": list(record.steps), "losses": [_number(v) for v in record.losses],
        "layers": list(record.layers), "norms": [[_number(v) for v in row] for row in record.norms],
        "usual": [None if u is None else [_number(u[0]), _number(u[1])] for u in record.usual],
        "onsets": [[layer, at] for layer, at in record.onsets], "leader": record.leader, "lead": record.lead,
        "tied": list(record.tied), "judged_by": record.judged_by, "data": record.data,
        "every": record.every,
        "output_onsets": [[module, at] for module, at in record.output_onsets],
        "update_norms": [_number(v) for v in record.update_norms],
    }
