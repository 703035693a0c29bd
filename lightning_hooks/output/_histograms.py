"""Writing a step's histograms: to TensorBoard in one event, to W&B as ``wandb.Histogram``, and to the listeners."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import Logger

from lightning_hooks.core._compat import TENSORBOARD_LOGGERS, WANDB_LOGGERS, callbacks_of
from lightning_hooks.output._tensorboard_wire import histogram_summary_bytes, write_summary
from lightning_hooks.output.fast_tensorboard import event_queue_of
from lightning_hooks.output.figures import FigureListener, HistogramBlock

#: Loggers that take histograms: TensorBoard, and W&B where wandb is installed.
HISTOGRAM_LOGGERS: tuple[type[Logger], ...] = TENSORBOARD_LOGGERS + WANDB_LOGGERS

#: The most bins a ``wandb.Histogram`` takes.
WANDB_MAX_BINS = 512

def log_histograms(trainer: pl.Trainer | Any, block: HistogramBlock, edges: Sequence[float], step: int) -> None:
    """Write a step's histograms to every TensorBoard and W&B logger of ``trainer``, from rank zero.

    TensorBoard gets them all in one event (what ``add_histogram_raw`` would write for each), with
    the true min, max, sum and sum of squares of the finite values, its protos built straight
    from the block's arrays; W&B in one ``log_metrics`` call, as ``wandb.Histogram`` (adjacent
    bins merged where there are more than W&B's 512). Empty leading and trailing bins are
    trimmed. A histogram with no finite value is not written (its NaN/Inf counts go out as
    scalars), so divergence never raises here.

    Args:
        trainer: The trainer whose loggers receive the histograms.
        block: The histograms, one row each, under tags such as ``"activations/encoder.0"``;
            handed to the listeners as they are.
        edges: Increasing bin edges, shared by all of them (``len(counts) + 1``).
        step: The global step to write at.
    """
    if not trainer.is_global_zero:
        return
    for listener in callbacks_of(trainer, FigureListener):
        listener.record_histograms(block, edges, step)
    shown = np.flatnonzero(block.summary["count_finite"] > 0)
    if not shown.size:
        return
    nonzero = block.counts[shown] > 0
    first = nonzero.argmax(1).tolist()
    last = (nonzero.shape[1] - nonzero[:, ::-1].argmax(1)).tolist()
    rows = list(zip(shown.tolist(), first, last))
    for logger in trainer.loggers:
        if isinstance(logger, TENSORBOARD_LOGGERS):
            _tensorboard_histograms(logger, block, rows, list(edges), step)
        elif isinstance(logger, WANDB_LOGGERS):
            logger.log_metrics({block.tags[i]: _wandb_histogram(block.counts[i, a:b], edges[a : b + 1])
                                for i, a, b in rows}, step=step)


def _tensorboard_histograms(logger: Logger, block: HistogramBlock, rows: list[tuple[int, int, int]],
                            edges: list[float], step: int) -> None:
    """Write the ``(row, first bin, one past the last)`` histograms of ``block`` to TensorBoard, in one event."""
    queue = event_queue_of(logger)
    if queue is not None:  # one event for all, as for scalars
        write_summary(queue, histogram_summary_bytes(block.tags, block.summary, block.counts, edges, rows), step)
        return
    s = {k: block.summary[k].tolist() for k in ("count_finite", "min", "max", "sum", "sum_sq")}
    counts = block.counts.tolist()
    for i, a, b in rows:  # the public method, one event each
        logger.experiment.add_histogram_raw(
            block.tags[i], global_step=step, min=s["min"][i], max=s["max"][i], num=int(s["count_finite"][i]),
            sum=s["sum"][i], sum_squares=s["sum_sq"][i], bucket_limits=edges[a + 1 : b + 1],
            bucket_counts=[int(c) for c in counts[i][a:b]])


def _wandb_histogram(counts: Sequence[float], edges: Sequence[float]) -> Any:
    """A ``wandb.Histogram`` of these counts and edges, adjacent bins merged to fit W&B's limit."""
    import wandb

    group = -(-len(counts) // WANDB_MAX_BINS)  # bins per merged bin
    merged = [sum(counts[i : i + group]) for i in range(0, len(counts), group)]
    merged_edges = [*edges[: len(counts) : group], edges[len(counts)]]
    return wandb.Histogram(np_histogram=(np.asarray(merged, dtype=np.int64), np.asarray(merged_edges)))
