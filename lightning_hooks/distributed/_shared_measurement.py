"""One gradient measurement per optimizer step, shared by every gradient callback of a Trainer.

GradientMonitor, GradientAnomalyStopping (and whatever reads the gradients next) each join the
:class:`SharedMeasurement` of their fit, which the first of them in ``trainer.callbacks`` makes in
its ``setup`` (how callbacks find each other: docs/architecture.md). The first whose ``on_before_optimizer_step``
runs measures the step for all: the norms once, each reader's flags and own figures, one
collective and one host transfer. The others then take their part of that result. So the Quick
start's three callbacks read every gradient once per step, however many of them are attached.

The host does not wait for that transfer where every reader can act a step late
(:meth:`StepReader._may_wait`): the transfer is started without blocking and read at the next
step's measurement (or at the end of training, :meth:`SharedMeasurement.finish`), where each
reader acts on it (:meth:`StepReader._late`) before the new step is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_hooks.distributed._rank_agreement import Agreed, Check, agree
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

    def _may_wait(self, trainer: pl.Trainer) -> bool:
        """Whether it can act on this step's figures a step late; the same answer on every rank."""

    def _moment(self, trainer: pl.Trainer) -> Any:
        """Where training is now, kept with a step read late and given back to :meth:`_late`."""

    def _late(self, trainer: pl.Trainer, optimizer: Any, step: Step, check: Check, moment: Any, at_end: bool) -> None:
        """Act on a step read a step late (``moment``: what :meth:`_moment` said when it was measured).

        ``at_end``: at the end of training, where no update follows and Lightning takes no ``self.log``.
        """


@dataclass
class _Pending:
    """A step measured and agreed, its transfer on the way: read and acted on at the next measurement."""

    trainer: pl.Trainer
    optimizer: Any
    readers: list[StepReader]
    agreed: Agreed
    moment: Any


Token = tuple[int, int]  # (the optimizer's id, the global step)
Result = Optional[tuple[Step, Check]]


class SharedMeasurement:
    """The measurement of each optimizer step of one fit, taken once and read by every reader."""

    def __init__(self) -> None:
        self.readers: list[StepReader] = []
        self.rounds = 0
        """How many times a step was measured (a test counts them)."""
        self.evaluation = 0
        """Which evaluation of the current step's closure was measured last, from 1 (LBFGS runs several)."""
        self._token: Optional[Token] = None
        self._shard_groups = ShardGroupCache()  # how the optimizer's gradients are split across ranks
        self._results: dict[int, tuple[Token, Result]] = {}
        self._pending: Optional[_Pending] = None

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
            self._token, self.evaluation, self._pending = None, 0, None

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
        self.finish()
        self.evaluation = self.evaluation + 1 if token == self._token else 1
        self._token = token
        readers = [r for r in self.readers if r._checks(trainer, self.evaluation)]
        self._results = {id(r): (token, None) for r in self.readers}
        if readers:
            self._measure(trainer, optimizer, readers, token)

    def finish(self, at_end: bool = False) -> None:
        """Read the step left pending, if any, and have its readers act on it now (a step late).

        ``at_end``: at the end of training, where no update follows.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        checks = pending.agreed.checks(remember=True)
        for reader, step, check in zip(pending.readers, pending.agreed.steps, checks):
            reader._late(pending.trainer, pending.optimizer, step, check, pending.moment, at_end)

    def _measure(self, trainer: pl.Trainer, optimizer: Any, readers: list[StepReader], token: Token) -> None:
        """Measure the step for ``readers``, in one collective and one host transfer.

        The L2 norms alone tell whether gradients are finite unless a norm is infinite, which a
        finite gradient whose float32 norm overflows also gives (not the CPU's C pass, whose float64
        sums cannot overflow: ``GradientFigures.exact``); only then (agreed across ranks) are the
        gradients measured again exactly, in a second collective and transfer.
        A step read a step late is not measured again (its gradients are gone): there a finite
        gradient whose norm overflows counts as non-finite. Only the first evaluation of a step
        joins the running medians; a closure evaluated several times (LBFGS) is read at once.
        """
        detectors = [r._detector for r in readers]
        remember = self.evaluation == 1
        steps = measure_step(trainer, optimizer, detectors, self._shard_groups, exact=False)
        votes = [r._votes(trainer, step) for r, step in zip(readers, steps)]
        extras = [r._extra(trainer, step) for r, step in zip(readers, steps)]
        agreed = agree(trainer, detectors, steps, extras, votes)
        self.rounds += 1
        if remember and not isinstance(optimizer, torch.optim.LBFGS) and all(r._may_wait(trainer) for r in readers):
            self._pending = _Pending(trainer, optimizer, readers, agreed, readers[0]._moment(trainer))
            return
        checks = agreed.checks(remember)
        if any(check.unsure for check in checks):
            steps = measure_step(trainer, optimizer, detectors, self._shard_groups, exact=True)
            checks = agree(trainer, detectors, steps, extras, votes).checks(remember)
        self._results.update({id(r): (token, (step, check)) for r, step, check in zip(readers, steps, checks)})
