"""One gradient measurement per optimizer step, shared by every gradient callback of a Trainer.

GradientMonitor, GradientAnomalyStopping (and whatever reads the gradients next) each join the
:class:`SharedMeasurement` of their Trainer. The first of them whose ``on_before_optimizer_step``
runs measures the step for all: the norms once, each reader's flags and own figures, one
collective and one host transfer. The others then take their part of that result. So the Quick
start's three callbacks read every gradient once per step, however many of them are attached.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import lightning.pytorch as pl
from torch import Tensor

from lightning_hooks._rank_agreement import Check, conclude
from lightning_hooks._sharding import ShardGroupCache
from lightning_hooks._step_measure import Step, measure_step
from lightning_hooks.anomalies import AnomalyDetector


class StepReader(Protocol):
    """What a callback that reads the step's measurement provides."""

    _detector: AnomalyDetector

    def _reads_step(self, trainer: pl.Trainer) -> bool:
        """Whether it reads this optimizer step (a monitor with no flag reads logged steps only)."""

    def _extra(self, trainer: pl.Trainer, step: Step) -> dict[str, Tensor]:
        """Its own device figures of the step, by name, to bring to the host in the step's one transfer."""


_BY_TRAINER: weakref.WeakKeyDictionary[Any, SharedMeasurement] = weakref.WeakKeyDictionary()


class SharedMeasurement:
    """The measurement of each optimizer step of one Trainer, taken once and read by every reader."""

    def __init__(self) -> None:
        self.readers: list[StepReader] = []
        self.rounds = 0
        """How many times a step was measured (a test counts them)."""
        self._shard_groups = ShardGroupCache()  # how the optimizer's gradients are split across ranks
        self._results: dict[int, tuple[tuple[int, int], Step, Check]] = {}

    @staticmethod
    def of(trainer: pl.Trainer) -> SharedMeasurement:
        """The Trainer's shared measurement, made at first use."""
        shared = _BY_TRAINER.get(trainer)
        if shared is None:
            shared = _BY_TRAINER[trainer] = SharedMeasurement()
        return shared

    def join(self, reader: StepReader) -> None:
        """Have ``reader`` measured with the others from now on (once, however often it joins)."""
        if all(r is not reader for r in self.readers):
            self.readers.append(reader)

    def leave(self, reader: StepReader) -> None:
        """Stop measuring for ``reader``; forget the shards' layout when nobody is left."""
        self.readers = [r for r in self.readers if r is not reader]
        self._results.pop(id(reader), None)
        if not self.readers:
            self._shard_groups.clear()

    def read(self, trainer: pl.Trainer, optimizer: Any, reader: StepReader) -> tuple[Step, Check]:
        """``reader``'s part of this optimizer step's measurement: measured now if it is the first to ask.

        A closure that an optimizer evaluates several times calls the hooks once per evaluation:
        each round of calls gets a measurement of its own.
        """
        token = (id(optimizer), trainer.global_step)
        held = self._results.pop(id(reader), None)
        if held is None or held[0] != token:
            self._measure(trainer, optimizer, reader, token)
            held = self._results.pop(id(reader))
        return held[1], held[2]

    def _measure(self, trainer: pl.Trainer, optimizer: Any, asking: StepReader, token: tuple[int, int]) -> None:
        """Measure the step for every reader that reads it, in one collective and one host transfer.

        The L2 norms alone tell whether gradients are finite unless a norm is infinite, which a
        finite gradient whose float32 norm overflows also gives; only then (agreed across
        ranks) are the gradients measured again exactly, in a second collective and transfer.
        """
        readers = [r for r in self.readers if r is asking or r._reads_step(trainer)]
        if all(r is not asking for r in readers):
            readers.append(asking)
        detectors = [r._detector for r in readers]
        steps = measure_step(trainer, optimizer, detectors, self._shard_groups, exact=False)
        extras = [r._extra(trainer, step) for r, step in zip(readers, steps)]
        checks = conclude(trainer, detectors, steps, extras)
        if any(check.unsure for check in checks):
            steps = measure_step(trainer, optimizer, detectors, self._shard_groups, exact=True)
            checks = conclude(trainer, detectors, steps, extras)
        self.rounds += 1
        self._results = {id(r): (token, step, check) for r, step, check in zip(readers, steps, checks)}
