"""One gradient measurement per optimizer step, shared by every gradient callback of a Trainer.

GradientMonitor, GradientAnomalyStopping (and whatever reads the gradients next) each join the
:class:`SharedMeasurement` of their Trainer. The first of them whose ``on_before_optimizer_step``
runs measures the step for all: the norms once, each reader's flags and own figures, one
collective and one host transfer. The others then take their part of that result. So the Quick
start's three callbacks read every gradient once per step, however many of them are attached.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Protocol

import lightning.pytorch as pl
from torch import Tensor

from lightning_hooks.distributed._rank_agreement import Check, conclude
from lightning_hooks.distributed._step_measure import Step, measure_step
from lightning_hooks.measure._sharding import ShardGroupCache
from lightning_hooks.measure.anomalies import AnomalyDetector


class StepReader(Protocol):
    """What a callback that reads the step's measurement provides."""

    _detector: AnomalyDetector

    def _checks(self, trainer: pl.Trainer, evaluation: int) -> bool:
        """Whether it reads evaluation ``evaluation`` (from 1) of the step's closure."""

    def _extra(self, trainer: pl.Trainer, step: Step) -> dict[str, Tensor]:
        """Its own device figures of the step, by name, to bring to the host in the step's one transfer."""

    def _votes(self, trainer: pl.Trainer, step: Step) -> dict[str, Tensor]:
        """Its own device figures to sum over the ranks in the step's one collective (before ``_extra``)."""


_BY_TRAINER: weakref.WeakKeyDictionary[Any, SharedMeasurement] = weakref.WeakKeyDictionary()

Token = tuple[int, int]  # (the optimizer's id, the global step)
Result = Optional[tuple[Step, Check]]


class SharedMeasurement:
    """The measurement of each optimizer step of one Trainer, taken once and read by every reader."""

    def __init__(self) -> None:
        self.readers: list[StepReader] = []
        self.rounds = 0
        """How many times a step was measured (a test counts them)."""
        self.evaluation = 0
        """Which evaluation of the current step's closure was measured last, from 1 (LBFGS runs several)."""
        self._token: Optional[Token] = None
        self._shard_groups = ShardGroupCache()  # how the optimizer's gradients are split across ranks
        self._results: dict[int, tuple[Token, Result]] = {}

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
            self._token, self.evaluation = None, 0

    def read(self, trainer: pl.Trainer, optimizer: Any, reader: StepReader) -> Result:
        """``reader``'s part of this evaluation's measurement, measured now if it is the first to ask.

        None when ``reader`` does not check this evaluation. An optimizer that evaluates its
        closure several times per step brings every reader here once per evaluation: each round
        of calls is an evaluation, with a measurement of its own.
        """
        token = (id(optimizer), trainer.global_step)
        held = self._results.get(id(reader))
        if held is None or held[0] != token:
            self.join(reader)
            self._evaluate(trainer, optimizer, token)
        return self._results.pop(id(reader))[1]

    def _evaluate(self, trainer: pl.Trainer, optimizer: Any, token: Token) -> None:
        """Start the next evaluation: measure it for the readers that check it."""
        self.evaluation = self.evaluation + 1 if token == self._token else 1
        self._token = token
        readers = [r for r in self.readers if r._checks(trainer, self.evaluation)]
        self._results = {id(r): (token, None) for r in self.readers}
        if readers:
            self._measure(trainer, optimizer, readers, token)

    def _measure(self, trainer: pl.Trainer, optimizer: Any, readers: list[StepReader], token: Token) -> None:
        """Measure the step for ``readers``, in one collective and one host transfer.

        The L2 norms alone tell whether gradients are finite unless a norm is infinite, which a
        finite gradient whose float32 norm overflows also gives; only then (agreed across
        ranks) are the gradients measured again exactly, in a second collective and transfer.
        Only the first evaluation of a step joins the running medians.
        """
        detectors = [r._detector for r in readers]
        remember = self.evaluation == 1
        steps = measure_step(trainer, optimizer, detectors, self._shard_groups, exact=False)
        votes = [r._votes(trainer, step) for r, step in zip(readers, steps)]
        extras = [r._extra(trainer, step) for r, step in zip(readers, steps)]
        checks = conclude(trainer, detectors, steps, extras, remember, votes)
        if any(check.unsure for check in checks):
            steps = measure_step(trainer, optimizer, detectors, self._shard_groups, exact=True)
            checks = conclude(trainer, detectors, steps, extras, remember, votes)
        self.rounds += 1
        self._results.update({id(r): (token, (step, check)) for r, step, check in zip(readers, steps, checks)})
