"""The flight recorder: the last N steps' loss and per-parameter gradient norms, on device, read on an anomaly.

:class:`FlightRecorder` keeps each step's figures (already measured for the step's check) in a
:class:`~lightning_hooks.measure._device_ring.DeviceRing`: one device copy per step, nothing read back;
with the update norm measured (``SpikeTrigger(update_norm=...)``), each step's too. The modules'
output std at ActivationMonitor's logged steps are kept on the host beside it
(:class:`~lightning_hooks.callbacks._flight_leader.OutputLevels`). When a step is acted on,
:meth:`FlightRecorder.read` brings the record to the host once and :func:`analyse` says which
layer left its usual range first, and how many steps before (``_flight_leader``);
:func:`write_record` writes it next to the logs (CSV) and to TensorBoard: a text for people
(``anomalies/flight_record``) and the same record as JSON for the Layers tab
(``anomalies/flight_record_data``, see :func:`~lightning_hooks.callbacks._flight_text.record_json`).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional, Union

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from lightning_hooks.callbacks._base import log_step
from lightning_hooks.callbacks._flight_leader import (
    MIN_BASELINE,
    Leader,
    OutputLevels,
    gradient_leader,
    onset,
    output_gradient_leader,
    output_leader,
    usual_level,
)
from lightning_hooks.callbacks._flight_record import FlightRecord, record_json, record_markdown, write_csv
from lightning_hooks.measure._device_ring import DeviceRing
from lightning_hooks.output._findings import owner_of
from lightning_hooks.output._plugin_data import FLIGHT_RECORD_TAG
from lightning_hooks.output.sinks import log_plugin_data, log_text


def _layer_norms(norms: np.ndarray, names: Sequence[str]) -> tuple[list[str], np.ndarray]:
    layers = list(dict.fromkeys(owner_of(n) for n in names))
    index = {layer: i for i, layer in enumerate(layers)}
    squares = np.zeros((norms.shape[0], len(layers)))
    for column, name in enumerate(names):
        squares[:, index[owner_of(name)]] += norms[:, column] ** 2
    return layers, np.sqrt(squares)


def _module_leader(outputs: OutputLevels) -> tuple[Optional[Leader], str]:
    """The leader from the modules' outputs, else (none out of range) from the gradients reaching them."""
    leader = output_leader(outputs.modules, outputs.array())
    if leader is not None or not outputs.gradient_modules:
        return leader, "outputs"
    return output_gradient_leader(outputs.gradient_modules, outputs.array(gradients=True)), "output gradients"


def analyse(step: int, steps: Sequence[int], losses: Union[Sequence[float], np.ndarray], norms: np.ndarray,
            names: Sequence[str], outputs: Optional[OutputLevels] = None,
            update_norms: Optional[Union[Sequence[float], np.ndarray]] = None) -> FlightRecord:
    """Which layer left its usual range first, before the anomaly at the last row.

    Args:
        step: The anomalous step.
        steps: The (log) step of each row of ``norms``.
        losses: The loss of each row.
        norms: ``(rows, parameters)``: the gradient norm of each parameter at each step.
        names: The parameters' names.
        outputs: The modules' output std at the logged steps up to the anomaly, if known: the
            leader is then judged from them (from those within the record's steps, at least 8;
            over a longer span a layer still learning its scale drifts out of its range); none
            out of range, from the gradients reaching them, if logged (``OutputLevels.add``).
        update_norms: The update norm of each row's step, if measured.

    Returns:
        The record, with its ``onsets`` and ``leader``.
    """
    layers, layer_norms = _layer_norms(norms, names)
    found = {layer: onset(layer_norms[:, i]) for i, layer in enumerate(layers)}
    order = sorted((d.row, i) for i, d in enumerate(found.values()) if d is not None)
    usual = tuple(usual_level(layer_norms[:, i], found[layer]) for i, layer in enumerate(layers))
    record = FlightRecord(step=step, steps=tuple(steps), losses=tuple(float(x) for x in losses),
                          layers=tuple(layers), norms=tuple(tuple(map(float, row)) for row in layer_norms),
                          usual=usual, onsets=tuple((layers[i], steps[row]) for row, i in order),
                          update_norms=() if update_norms is None else tuple(map(float, update_norms)))
    if len(steps) < 2 * MIN_BASELINE:
        return record
    leader, at = None, steps
    outputs = outputs.since(steps[0]) if outputs is not None and steps else None  # the record's span only
    if outputs is not None and len(outputs.steps) >= 2 * MIN_BASELINE:
        departures = outputs.departures()
        record = replace(record, output_onsets=tuple((m, outputs.steps[d.row]) for m, d in departures))
        leader, judged_by = _module_leader(outputs)
        if leader is not None:
            record, at = replace(record, judged_by=judged_by), outputs.steps
    if leader is None:
        leader, at = gradient_leader(layers, found, sum(u is not None for u in usual)), steps
    if leader is None:
        return record
    return replace(record, leader=leader.names[0], tied=leader.names[1:], lead=step - at[leader.row],
                   rise=float(np.exp(leader.change)), data=leader.data, every=leader.every)


class FlightRecorder:
    """The last ``steps`` optimizer steps' loss, per-parameter gradient norms and update norm, on device.

    Each row is ``[loss, gradient norms...]``, with ``updates`` ``[loss, update norm, gradient
    norms...]``: the update norm a step's check judges is the step before's (an update is known
    only once made), so it is kept in that row and moved up one row when read.

    Args:
        steps: How many steps it keeps.
        updates: Whether each row holds an update norm.
    """

    def __init__(self, steps: int, updates: bool = False) -> None:
        self.ring = DeviceRing(steps)
        self.steps: deque[int] = deque(maxlen=steps)
        self.updates = updates

    def record(self, step: int, loss: Tensor, norms: Tensor, update: Optional[Tensor] = None) -> None:
        """Keep step ``step``'s loss (0-d), gradient norms (one per parameter) and the step before's update norm.

        One device copy. ``update`` is kept with ``updates`` only (None there: NaN).
        """
        parts = [loss.reshape(1).to(norms.device, norms.dtype)]
        if self.updates:
            parts.append(torch.full((1,), math.nan, dtype=norms.dtype, device=norms.device) if update is None
                         else update.reshape(1).to(norms.device, norms.dtype))
        self.ring.push(torch.cat([*parts, norms.reshape(-1)]))
        if self.ring.count == 1:  # a new ring (the parameters changed): the steps start again
            self.steps.clear()
        self.steps.append(step)

    def read(self, step: int, names: Sequence[str], outputs: Optional[OutputLevels] = None) -> Optional[FlightRecord]:
        """Bring the record to the host (one transfer) and analyse it; None before the first step."""
        rows = self.ring.ordered()
        first = 2 if self.updates else 1  # the first gradient norm's column
        if rows is None or rows.shape[1] - first != len(names):
            return None
        host = rows.cpu().numpy()
        updates = np.append(host[1:, 1], math.nan) if self.updates else None  # each row's own step's update
        return analyse(step, list(self.steps), host[:, 0], host[:, first:], names, outputs, updates)

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
        write_csv(folder, path, record)
        record = replace(record, path=path)
    except OSError as err:  # a full disk, a read-only log dir: the record is still kept, logged and acted on
        discard_file(path)
        warnings.warn(f"the flight record of step {record.step} could not be written to {path}"
                      f" ({type(err).__name__}: {err}); it is kept in the report (`flight_record`) and in"
                      " TensorBoard (anomalies/flight_record); training goes on.", stacklevel=2)
    log_text(trainer, "anomalies/flight_record", record_markdown(record), log_step(trainer))
    log_plugin_data(trainer, FLIGHT_RECORD_TAG, json.dumps(record_json(record)), log_step(trainer))
    return record


def discard_file(path: str) -> None:
    """Remove what a failed write left at ``path``, if anything (a partial file)."""
    try:
        os.remove(path)
    except OSError:
        pass
