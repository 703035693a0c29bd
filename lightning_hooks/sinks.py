"""Writing figures to Lightning loggers: scalars anywhere, histograms to TensorBoard and W&B, text to TensorBoard."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import histogram_raw

from lightning_hooks._listeners import listeners


def log_scalars(trainer: pl.Trainer | Any, metrics: Mapping[str, float], step: int) -> None:
    """Send scalars to every logger of ``trainer``, from rank zero.

    A TensorBoardLogger gets all of them in one event: ``log_metrics`` writes an event per
    scalar, and each costs about 50 µs (a hand-off to the writer thread), which with a dozen
    figures per module was most of a logged step's cost after the statistics themselves.
    """
    if not trainer.is_global_zero or not metrics:
        return
    for listener in listeners(trainer):
        listener.record_scalars(metrics, step)
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
    events = _event_writer(logger)
    if events is None:
        return False
    events.add_summary(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))
                                      for tag, value in metrics.items()]), step)
    return True


def _event_writer(logger: TensorBoardLogger) -> Any:
    """The event file writer behind torch's ``SummaryWriter``; None for tensorboardX's (other protos)."""
    writer = logger.experiment
    return writer._get_file_writer() if isinstance(writer, SummaryWriter) else None


#: Loggers that take histograms: TensorBoard, and W&B where wandb is installed.
HISTOGRAM_LOGGERS: tuple[type[Logger], ...] = (TensorBoardLogger, WandbLogger)

#: The most bins a ``wandb.Histogram`` takes.
WANDB_MAX_BINS = 512

Histogram = tuple[str, Mapping[str, float], Sequence[float]]
"""One histogram: its tag, a summary with ``count_finite``, ``min``, ``max``, ``sum`` and
``sum_sq`` of the values, and the count per bin."""


def log_histograms(trainer: pl.Trainer | Any, histograms: Sequence[Histogram], edges: Sequence[float],
                   step: int) -> None:
    """Write a step's histograms to every TensorBoard and W&B logger of ``trainer``, from rank zero.

    TensorBoard gets them all in one event (as ``add_histogram_raw`` would write each), with
    the true min, max, sum and sum of squares of the finite values; W&B in one ``log_metrics`` call, as
    ``wandb.Histogram`` (adjacent bins merged where there are more than W&B's 512). Empty
    leading and trailing bins are trimmed. A histogram with no finite value is not written
    (its NaN/Inf counts go out as scalars), so divergence never raises here.

    Args:
        trainer: The trainer whose loggers receive the histograms.
        histograms: ``(tag, summary, counts)`` per histogram, e.g. tag ``"activations/encoder.0"``.
        edges: Increasing bin edges, shared by all of them (``len(counts) + 1``).
        step: The global step to write at.
    """
    if not trainer.is_global_zero:
        return
    for listener in listeners(trainer):
        listener.record_histograms(histograms, edges, step)
    shown = [(tag, summary, counts, _span(counts)) for tag, summary, counts in histograms
             if summary["count_finite"] > 0]
    if not shown:
        return
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            raw = [(tag, {
                "min": summary["min"], "max": summary["max"], "num": int(summary["count_finite"]),
                "sum": summary["sum"], "sum_squares": summary["sum_sq"],
                "bucket_limits": list(edges[first + 1 : last + 1]),
                "bucket_counts": [int(c) for c in counts[first:last]],
            }) for tag, summary, counts, (first, last) in shown]
            events = _event_writer(logger)
            if events is not None:  # one event for all, as for scalars
                events.add_summary(Summary(value=[v for tag, kw in raw for v in histogram_raw(tag, **kw).value]), step)
            else:  # tensorboardX: its own method
                for tag, kw in raw:
                    logger.experiment.add_histogram_raw(tag, global_step=step, **kw)
        elif isinstance(logger, WandbLogger):
            logger.log_metrics({tag: _wandb_histogram(counts[first:last], edges[first : last + 1])
                                for tag, _, counts, (first, last) in shown}, step=step)


def _span(counts: Sequence[float]) -> tuple[int, int]:
    """The first non-empty bin and one past the last."""
    nonzero = [i for i, c in enumerate(counts) if c > 0]
    return nonzero[0], nonzero[-1] + 1


def _wandb_histogram(counts: Sequence[float], edges: Sequence[float]) -> Any:
    """A ``wandb.Histogram`` of these counts and edges, adjacent bins merged to fit W&B's limit."""
    import wandb

    group = -(-len(counts) // WANDB_MAX_BINS)  # bins per merged bin
    merged = [sum(counts[i : i + group]) for i in range(0, len(counts), group)]
    merged_edges = [*edges[: len(counts) : group], edges[len(counts)]]
    return wandb.Histogram(np_histogram=(np.asarray(merged, dtype=np.int64), np.asarray(merged_edges)))


def log_text(trainer: pl.Trainer | Any, tag: str, text: str, step: int) -> None:
    """Write a text entry (e.g. a provenance report) to every TensorBoardLogger, from rank zero."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, text, global_step=step)
