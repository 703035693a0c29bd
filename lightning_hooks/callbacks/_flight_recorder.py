"""The flight recorder: the last N steps' loss and per-parameter gradient norms, on device, read on an anomaly.

:class:`FlightRecorder` keeps each step's figures (already measured for the step's check) in a
:class:`~lightning_hooks.measure.spikes.DeviceRing`: one device copy per step, nothing read back.
When a step is acted on, :meth:`FlightRecorder.read` brings the record to the host once and
:func:`analyse` says which layer's gradient norm left its usual range first, and how many steps
before; :func:`write_record` writes it next to the logs (CSV) and to TensorBoard: a text for
people (``anomalies/flight_record``) and the same record as JSON for the Layers tab
(``anomalies/flight_record_data``, see :func:`record_json`).
"""

from __future__ import annotations

import csv
import json
import math
import os
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from lightning_hooks.callbacks._base import log_step
from lightning_hooks.measure.spikes import _MAD_TO_STD, DeviceRing
from lightning_hooks.output._plugin_data import FLIGHT_RECORD_TAG
from lightning_hooks.output.sinks import log_plugin_data, log_text

_BAND_Z = 3.0  # a layer's norm is out of its usual range beyond 3 robust standard deviations (of its log) ...
_MIN_BAND = float(np.log(1.5))  # ... and beyond a factor 1.5 either way, however steady it was
_MIN_BASELINE = 4  # the usual range needs this many steps before the record's second half


@dataclass(frozen=True)
class FlightRecord:
    """The loss and the per-layer gradient norms of the steps up to an anomaly, and which layer led.

    A layer is a module: the gradient norms of its parameters are combined (the root of the sum
    of their squares). A layer "left" its usual range at the earliest step from which its norm
    stayed out, to the anomaly, of the range of its norms before that step (the median and the
    spread of their logarithm: more than 3 robust standard deviations and a factor of 1.5 away,
    up or down), so a ramp does not widen its own range.

    Attributes:
        step: The log step of the anomalous step (the last row): the loggers' step, as in TensorBoard.
        steps: The log step of each row, oldest first.
        losses: The loss of each row (rank zero's, as backpropagated); NaN where none was seen.
        layers: The layers, in the optimizer's order of their parameters.
        norms: Per row, the gradient norm of each layer.
        onsets: The layers whose norm was out of range at the anomaly, with the step it left its
            range at, earliest first (ties: the larger change first).
        leader: The first of ``onsets``, or None.
        tied: The layers that left their range at the same step as ``leader``: a tie, said as one
            (every layer at once: the batch, not a layer).
        lead: How many steps before the anomaly ``leader`` left its range.
        rise: ``leader``'s norm at the anomaly over its usual norm.
        usual: Per layer, its usual range as ``(norm, factor)``: the median of its norm before it
            left its range (over the record's first half for a layer that did not), and how far (a
            factor, either way) the norm may stray from it before it is out of range; None for a
            layer without enough finite norms to tell.
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
    path: Optional[str] = None

    def summary(self) -> str:
        """One line: which layer left its range first, how many steps before, and where the record is."""
        span = f"flight record of steps {self.steps[0]}-{self.steps[-1]}" if self.steps else "empty flight record"
        if len(self.steps) < 2 * _MIN_BASELINE:
            text = f"{span}: too few steps to tell a layer's usual gradient norm range"
        elif self.leader is None:
            text = f"{span}: no layer's gradient norm was out of its usual range at step {self.step}"
        else:
            start = self.step - (self.lead or 0)
            then = ", ".join(f"{layer!r} at step {at}" for layer, at in self.onsets[1 + len(self.tied):4])
            if self.tied and 1 + len(self.tied) == sum(u is not None for u in self.usual):
                text = (f"{span}: all {1 + len(self.tied)} layers left their usual gradient norm range at the same"
                        f" step {start}, {self.lead} steps before: every layer at once, look at the batch")
            elif self.tied:
                names = ", ".join(repr(layer) for layer in (self.leader, *self.tied))
                text = (f"{span}: a tie, {1 + len(self.tied)} layers left their usual gradient norm range at the same"
                        f" step {start}, {self.lead} steps before: {names} (a gradient flows through every layer"
                        f" before it: LayerHealth's verdict, from the outputs, names the layer)"
                        + (f"; then {then}" if then else ""))
            else:
                text = (f"{span}: layer {self.leader!r} left its usual gradient norm range first, {self.lead} steps"
                        f" before (at step {start}; x{self.rise:.3g} at step {self.step})"
                        + (f"; then {then}" if then else ""))
        return text + (f"; written to {self.path}" if self.path else "")


def layer_of(name: str) -> str:
    """The module a parameter belongs to: its name without the last part."""
    return name.rsplit(".", 1)[0] if "." in name else name


def _layer_norms(norms: np.ndarray, names: Sequence[str]) -> tuple[list[str], np.ndarray]:
    layers = list(dict.fromkeys(layer_of(n) for n in names))
    index = {layer: i for i, layer in enumerate(layers)}
    squares = np.zeros((norms.shape[0], len(layers)))
    for column, name in enumerate(names):
        squares[:, index[layer_of(name)]] += norms[:, column] ** 2
    return layers, np.sqrt(squares)


def _usual_range(logs: np.ndarray) -> Optional[tuple[float, float]]:
    """The median and the half-width of the usual range of a log series; None if it has too few finite points."""
    base = logs[np.isfinite(logs)]
    if len(base) < _MIN_BASELINE:
        return None
    median = float(np.median(base))
    return median, max(_BAND_Z * _MAD_TO_STD * float(np.median(np.abs(base - median))), _MIN_BAND)


def _onset(series: np.ndarray) -> Optional[tuple[int, float, tuple[float, float]]]:
    """Where the series left its usual range, measured before it left: the row, the log change at the end, the range.

    The earliest row ``t`` from which every point to the end is out of the range of the points
    before ``t`` (a ramp cannot widen its own range); None if the last point is in range.
    """
    logs = np.log(np.where(series > 0, series, np.nan))
    if not np.isfinite(logs[-1]):
        return None
    for t in range(_MIN_BASELINE, len(logs)):
        usual = _usual_range(logs[:t])
        if usual is None:
            continue
        median, band = usual
        if not (np.abs(logs[t:] - median) <= band).any():  # a NaN (no gradient) counts as out of range
            return t, float(logs[-1] - median), usual
    return None


def _usual(series: np.ndarray, onset: Optional[int]) -> Optional[tuple[float, float]]:
    """A layer's usual range as ``(norm, factor)``, from before its onset (else the record's first half), or None."""
    logs = np.log(np.where(series > 0, series, np.nan))
    usual = _usual_range(logs[: onset if onset is not None else len(logs) // 2])
    return None if usual is None else (float(np.exp(usual[0])), float(np.exp(usual[1])))


def analyse(step: int, steps: Sequence[int], losses: Union[Sequence[float], np.ndarray], norms: np.ndarray,
            names: Sequence[str]) -> FlightRecord:
    """Which layer's gradient norm left its usual range first, before the anomaly at the last row.

    Args:
        step: The anomalous step.
        steps: The (log) step of each row of ``norms``.
        losses: The loss of each row.
        norms: ``(rows, parameters)``: the gradient norm of each parameter at each step.
        names: The parameters' names.

    Returns:
        The record, with its ``onsets`` and ``leader``.
    """
    layers, layer_norms = _layer_norms(norms, names)
    found = {layer: _onset(layer_norms[:, i]) for i, layer in enumerate(layers)}
    starts = {layer: None if onset is None else onset[0] for layer, onset in found.items()}
    onsets = sorted(((layer, steps[at], change) for layer, (at, change, _) in
                     ((k, v) for k, v in found.items() if v is not None)), key=lambda o: (o[1], -abs(o[2])))
    record = FlightRecord(step=step, steps=tuple(steps), losses=tuple(float(x) for x in losses),
                          layers=tuple(layers), norms=tuple(tuple(map(float, row)) for row in layer_norms),
                          usual=tuple(_usual(layer_norms[:, i], starts[layer]) for i, layer in enumerate(layers)),
                          onsets=tuple((layer, at) for layer, at, _ in onsets))
    if not onsets:
        return record
    leader, at, change = onsets[0]
    tied = tuple(layer for layer, other, _ in onsets[1:] if other == at)
    return replace(record, leader=leader, lead=step - at, rise=float(np.exp(change)), tied=tied)


class FlightRecorder:
    """The last ``steps`` optimizer steps' loss and per-parameter gradient norms, on device.

    Args:
        steps: How many steps it keeps.
    """

    def __init__(self, steps: int) -> None:
        self.ring = DeviceRing(steps)
        self.steps: deque[int] = deque(maxlen=steps)

    def record(self, step: int, loss: Tensor, norms: Tensor) -> None:
        """Keep step ``step``'s loss (0-d) and gradient norms (one per parameter): one device copy."""
        self.ring.push(torch.cat([loss.reshape(1).to(norms.device, norms.dtype), norms.reshape(-1)]))
        if self.ring.count == 1:  # a new ring (the parameters changed): the steps start again
            self.steps.clear()
        self.steps.append(step)

    def read(self, step: int, names: Sequence[str]) -> Optional[FlightRecord]:
        """Bring the record to the host (one transfer) and analyse it; None before the first step."""
        rows = self.ring.ordered()
        if rows is None or rows.shape[1] - 1 != len(names):
            return None
        host = rows.cpu().numpy()
        return analyse(step, list(self.steps), host[:, 0], host[:, 1:], names)

    def clear(self) -> None:
        """Forget every step."""
        self.ring = DeviceRing(self.ring.size)
        self.steps.clear()


def write_record(trainer: pl.Trainer, record: FlightRecord) -> FlightRecord:
    """Write the record next to the logs as CSV and to TensorBoard (a text table; JSON for the Layers tab); return it.

    Written from rank zero; the returned record has its CSV path.

    Every rank must call it: ``trainer.log_dir`` is broadcast from rank zero.
    """
    folder = trainer.log_dir or trainer.default_root_dir
    if not trainer.is_global_zero:
        return record
    path = os.path.join(folder, f"flight-record-step{record.step}.csv")
    try:
        _write_csv(folder, path, record)
        record = replace(record, path=path)
    except OSError as err:  # a full disk, a read-only log dir: the record is still kept, logged and acted on
        discard_file(path)
        warnings.warn(f"the flight record of step {record.step} could not be written to {path}"
                      f" ({type(err).__name__}: {err}); it is kept in the report (`flight_record`) and in"
                      " TensorBoard (anomalies/flight_record); training goes on.", stacklevel=2)
    log_text(trainer, "anomalies/flight_record", record_markdown(record), log_step(trainer))
    log_plugin_data(trainer, FLIGHT_RECORD_TAG, json.dumps(record_json(record)), log_step(trainer))
    return record


def _write_csv(folder: str, path: str, record: FlightRecord) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "loss", *(f"grad_norm/{layer}" for layer in record.layers)])
        for step, loss, row in zip(record.steps, record.losses, record.norms):
            writer.writerow([step, f"{loss:.6g}", *(f"{v:.6g}" for v in row)])


def discard_file(path: str) -> None:
    """Remove what a failed write left at ``path``, if anything (a partial file)."""
    try:
        os.remove(path)
    except OSError:
        pass


def record_markdown(record: FlightRecord) -> str:
    """The record as the Text tab shows it (markdown): the summary, then the layers by when they left their range."""
    lines = [record.summary().replace("_", "\\_")]
    if record.onsets:
        usual = dict(zip(record.layers, record.usual))
        last = dict(zip(record.layers, record.norms[-1])) if record.norms else {}
        head = "| layer | left its range at step | steps before the anomaly | usual norm | norm at the anomaly |"
        lines += ["", head]
        lines.append("|---|---:|---:|---:|---:|")
        for layer, at in record.onsets:
            level = usual.get(layer)
            name, typical = layer.replace("_", "\\_"), "" if level is None else f"{level[0]:.4g}"
            lines.append(f"| {name} | {at} | {record.step - at} | {typical} | {last.get(layer, math.nan):.4g} |")
    return "\n".join(lines)


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
    ``lead``, ``tied`` (the layers that left at the leader's step). Non-finite numbers are the strings
    ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.
    """
    return {
        "step": record.step, "steps": list(record.steps), "losses": [_number(v) for v in record.losses],
        "layers": list(record.layers), "norms": [[_number(v) for v in row] for row in record.norms],
        "usual": [None if u is None else [_number(u[0]), _number(u[1])] for u in record.usual],
        "onsets": [[layer, at] for layer, at in record.onsets], "leader": record.leader, "lead": record.lead,
        "tied": list(record.tied),
    }
