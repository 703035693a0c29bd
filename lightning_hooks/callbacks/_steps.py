"""Which step it is: the step Lightning's loggers record, whether it is logged, and a step acted on late.

The clock every callback of this package reads (importable from ``_base`` with :class:`HookCallback`):
:func:`log_step` is Lightning's own logging step, :func:`moment` where training is, and within
:func:`acting_late` both give the step whose check is read a step late.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Optional

import lightning.pytorch as pl

from lightning_hooks.core._validation import check_int


def _validate_interval(value: Any) -> None:
    """Check a ``log_every_n_steps`` argument: a positive int (not a bool) or None."""
    check_int("log_every_n_steps", value, optional=True)


def _log_interval(log_every_n_steps: Optional[int], trainer: pl.Trainer) -> int:
    """The steps between logged steps: the callback's own setting, else the Trainer's.

    0 means never: ``Trainer(log_every_n_steps=0)`` turns logging off, and so it does here.
    """
    if log_every_n_steps is not None:
        return log_every_n_steps
    return getattr(trainer, "log_every_n_steps", 50)


def log_step(trainer: pl.Trainer) -> int:
    """The step Lightning's loggers record for the training batch running now.

    That is the fit loop's count of batches that stepped (``_batches_that_stepped``, what
    ``self.log``, ``LearningRateMonitor`` and ``DeviceStatsMonitor`` write at): it counts each
    batch that ends an optimizer step once (``accumulate_grad_batches`` batches count once,
    several optimizers in one batch count once) and goes up only after ``on_train_batch_end``.
    ``trainer.global_step`` where the loop has no such count. While a step's check is acted on
    a step late (:func:`acting_late`), that step's.
    """
    if _LATE:  # the usual case, nothing acted on late: no look-up
        late = _LATE.get(id(trainer))
        if late is not None:
            return late.log_step
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    # Not `trainer.global_step` as getattr's default: it would be read (a chain of properties) at every call.
    stepped = getattr(loop, "_batches_that_stepped", None)
    return int(stepped) if stepped is not None else int(trainer.global_step)


class Moment(NamedTuple):
    """Where training was when a step was measured: what its late reader logs and reports it at."""

    log_step: int
    global_step: int
    epoch: int


# Per Trainer (by id: only while `acting_late` runs, which always removes it): the step acted on now, a step late.
_LATE: dict[int, Moment] = {}


def moment(trainer: pl.Trainer) -> Moment:
    """The step running now (or the one acted on late): its log step, global step and epoch."""
    late = _LATE.get(id(trainer)) if _LATE else None
    return late if late is not None else Moment(log_step(trainer), trainer.global_step, trainer.current_epoch)


@contextmanager
def acting_late(trainer: pl.Trainer, at: Moment) -> Iterator[None]:
    """Within it, :func:`log_step` and :func:`moment` give the step ``at``: a check read a step late logs there."""
    _LATE[id(trainer)] = at
    try:
        yield
    finally:
        _LATE.pop(id(trainer), None)


def _is_logged_step(step: int, every: int) -> bool:
    """Whether log step ``step`` (see :func:`log_step`) is logged at an interval of ``every`` (0: never).

    Lightning's own timing (``(step + 1) % every == 0``: steps 4, 9, 14 … for 5), so our points
    share steps with the user's ``self.log``, and step 0, the start of training.
    """
    return every > 0 and (step == 0 or (step + 1) % every == 0)
