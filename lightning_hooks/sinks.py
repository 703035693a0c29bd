"""Writing figures to Lightning loggers: TensorBoard histograms and text, scalars anywhere."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter


def log_scalars(trainer: pl.Trainer | Any, metrics: Mapping[str, float], step: int) -> None:
    """Send scalars to every logger of ``trainer``, from rank zero.

    A TensorBoardLogger gets all of them in one event: ``log_metrics`` writes an event per
    scalar, and each costs about 50 µs (a hand-off to the writer thread), which with a dozen
    figures per module was most of a logged step's cost after the statistics themselves.
    """
    if not trainer.is_global_zero or not metrics:
        return
    for logger in trainer.loggers:
        if not _write_one_event(logger, metrics, step):
            logger.log_metrics(dict(metrics), step=step)


def _write_one_event(logger: Logger, metrics: Mapping[str, float], step: int) -> bool:
    """Write ``metrics`` as one TensorBoard event, as ``add_scalar`` would each; False if we cannot.

    Only for Lightning's own ``log_metrics`` (a subclass may filter or rename), without a
    prefix, and for plain numbers.
    """
    if (
        not isinstance(logger, TensorBoardLogger)
        or type(logger).log_metrics is not TensorBoardLogger.log_metrics
        or logger._prefix
        or not all(isinstance(value, (int, float)) for value in metrics.values())
    ):
        return False
    writer = logger.experiment
    if not isinstance(writer, SummaryWriter):  # tensorboardX's writer has its own protos
        return False
    values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in metrics.items()]
    writer._get_file_writer().add_summary(Summary(value=values), step)
    return True


def log_histogram(
    trainer: pl.Trainer | Any,
    tag: str,
    summary: Mapping[str, float],
    counts: Sequence[float],
    edges: Sequence[float],
    step: int,
) -> None:
    """Write one histogram to every TensorBoardLogger of ``trainer``, from rank zero.

    Uses ``add_histogram_raw`` with the true min, max, sum and sum of squares of the finite
    values; empty leading and trailing bins are trimmed. A histogram with no finite value is
    not written (its NaN/Inf counts go out as scalars), so divergence never raises here.

    Args:
        trainer: The trainer whose loggers receive the histogram.
        tag: The histogram's tag, e.g. ``"activations/encoder.0/histogram"``.
        summary: ``count_finite``, ``min``, ``max``, ``sum``, ``sum_sq`` of the values.
        counts: Count per bin (``len(edges) - 1`` of them).
        edges: Increasing bin edges.
        step: The global step to write at.
    """
    if not trainer.is_global_zero or summary["count_finite"] <= 0:
        return
    writers = [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
    if not writers:
        return
    nonzero = [i for i, c in enumerate(counts) if c > 0]
    first, last = nonzero[0], nonzero[-1] + 1
    for writer in writers:
        writer.add_histogram_raw(
            tag,
            min=summary["min"],
            max=summary["max"],
            num=int(summary["count_finite"]),
            sum=summary["sum"],
            sum_squares=summary["sum_sq"],
            bucket_limits=list(edges[first + 1 : last + 1]),
            bucket_counts=[int(c) for c in counts[first:last]],
            global_step=step,
        )


def log_text(trainer: pl.Trainer | Any, tag: str, text: str, step: int) -> None:
    """Write a text entry (e.g. a provenance report) to every TensorBoardLogger, from rank zero."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, text, global_step=step)
