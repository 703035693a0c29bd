"""Writing to loggers: scalars anywhere; text, the Layers tab's data and layouts to TensorBoard."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional
from weakref import WeakKeyDictionary

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import custom_scalars
from torch.utils.tensorboard.writer import FileWriter

from lightning_hooks.core._compat import CSV_LOGGERS, TENSORBOARD_LOGGERS, callbacks_of
from lightning_hooks.output._histograms import HISTOGRAM_LOGGERS
from lightning_hooks.output._plugin_data import plugin_data_summary
from lightning_hooks.output._tensorboard_wire import scalar_summary_bytes, write_summary
from lightning_hooks.output.fast_tensorboard import event_queue_of
from lightning_hooks.output.figures import FigureListener, ScalarBlock, as_metrics


def log_scalars(trainer: pl.Trainer | Any, metrics: Mapping[str, float], step: int,
                figures: Sequence[ScalarBlock] = ()) -> None:
    """Send scalars to every logger of ``trainer``, and to the listeners, from rank zero.

    A TensorBoardLogger gets all of them in one event: ``log_metrics`` writes an event per
    scalar, and each costs about 50 µs (a hand-off to the writer thread), which with a dozen
    figures per module was most of a logged step's cost after the statistics themselves.

    Args:
        trainer: The trainer whose loggers and listeners receive them.
        metrics: Scalars by tag that belong to no row (``gradients/total_norm``, the flags).
        step: The step to write at.
        figures: The rows' scalars, one typed block per statistic: written after ``metrics``
            under their tags, and handed to the listeners as they are.
    """
    if not trainer.is_global_zero:
        return
    if figures:
        metrics = as_metrics(figures, metrics)
    if not metrics:
        return
    for listener in callbacks_of(trainer, FigureListener):
        listener.record_figures(figures, metrics, step)
    for logger in trainer.loggers:
        if not _write_one_event(logger, metrics, step) and not _add_to_row(logger, metrics, step):
            logger.log_metrics(dict(metrics), step=step)


def _add_to_row(logger: Logger, metrics: Mapping[str, float], step: int) -> bool:
    """Add ``metrics`` to a CSVLogger's unsaved row of ``step``, so that every callback's figures share one row.

    ``CSVLogger.log_metrics`` starts a row per call, and each callback writes at its own hook of
    the step. Only Lightning's own ``log_metrics``, without a prefix; False where there is no such row.
    The LightningModule's own ``self.log`` values are not merged: Lightning writes them in a row of
    their own after the callbacks' hooks of the step, with the same ``step``.
    """
    if (not isinstance(logger, CSV_LOGGERS) or type(logger).log_metrics not in _CSV_LOG_METRICS
            or logger._prefix):
        return False
    rows = getattr(logger.experiment, "metrics", None)
    if not isinstance(rows, list) or not rows or not isinstance(rows[-1], dict) or rows[-1].get("step") != step:
        return False
    rows[-1].update(metrics)
    return True


#: Each package's own ``CSVLogger.log_metrics``.
_CSV_LOG_METRICS = tuple(cls.log_metrics for cls in CSV_LOGGERS)


def _write_one_event(logger: Logger, metrics: Mapping[str, float], step: int) -> bool:
    """Write ``metrics`` as one TensorBoard event, as ``add_scalar`` would each; False if we cannot.

    Only for Lightning's own ``log_metrics`` (a subclass may filter or rename), without a
    prefix, and for plain numbers.
    """
    if (
        not isinstance(logger, TENSORBOARD_LOGGERS)
        or type(logger).log_metrics not in _TENSORBOARD_LOG_METRICS
        or logger._prefix
        or not all(isinstance(value, (int, float)) for value in metrics.values())
    ):
        return False
    queue = event_queue_of(logger)
    if queue is None:
        return False
    write_summary(queue, scalar_summary_bytes(list(metrics), list(metrics.values())), step)
    return True


#: Each package's own ``TensorBoardLogger.log_metrics``: one event per scalar is all they do.
_TENSORBOARD_LOG_METRICS = tuple(cls.log_metrics for cls in TENSORBOARD_LOGGERS)


def destinations(trainer: pl.Trainer | Any, owner: str, histogram: bool, listened_histograms: bool,
                 skipped: str) -> tuple[bool, bool]:
    """Whether ``owner``'s figures, and its histograms, are written anywhere; warn (rank zero) where not.

    Figures go to the Trainer's loggers and to the callbacks that listen to them (LayerHealth);
    histograms to TensorBoard and W&B loggers, and to listeners where ``listened_histograms``.
    What a user asked for and would silently lose gets a warning, once per ``fit``: every
    figure, with no logger (``logger=False``) and no listener, saying what ``owner`` then
    leaves out (``skipped``); or the histograms, with loggers that take none (a CSVLogger only).

    Returns:
        ``(figures, histograms)``: whether each is written anywhere.
    """
    listening = bool(callbacks_of(trainer, FigureListener))
    figures = bool(trainer.loggers) or listening
    histograms = histogram and ((listening and listened_histograms)
                                or any(isinstance(lg, HISTOGRAM_LOGGERS) for lg in trainer.loggers))
    if not figures:
        rank_zero_warn(f"{owner}: the Trainer has no logger (logger=False), so its figures would be written"
                       f" nowhere: {skipped}. Give the Trainer a logger (e.g. TensorBoardLogger) to see them.")
    elif histogram and not histograms:
        kinds = ", ".join(sorted({type(lg).__name__ for lg in trainer.loggers})) or "no logger"
        rank_zero_warn(f"{owner}: `histogram=True` but no logger takes histograms (the Trainer has {kinds}):"
                       " they are not written. Add a TensorBoardLogger or WandbLogger, or pass histogram=False.")
    return figures, histograms


def log_text(trainer: pl.Trainer | Any, tag: str, text: str, step: int) -> None:
    """Write a text entry (e.g. a provenance report) to every TensorBoardLogger, from rank zero."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if isinstance(logger, TENSORBOARD_LOGGERS):
            logger.experiment.add_text(tag, text, global_step=step)


def log_plugin_data(trainer: pl.Trainer | Any, tag: str, text: str, step: int) -> None:
    """Write an entry only the Layers tab reads (JSON) to every TensorBoardLogger, from rank zero.

    Written as a summary of the tab's own plugin (:mod:`lightning_hooks.output._plugin_data`), so
    the Text tab does not list it: through the fast path, else through torch's public
    ``file_writer.add_summary``. tensorboardX's writer has protos of its own: there it is written
    as text, which the tab reads too.
    """
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if not isinstance(logger, TENSORBOARD_LOGGERS):
            continue
        queue = event_queue_of(logger)
        file_writer = None if queue is not None else _torch_file_writer(logger.experiment)
        if queue is not None:
            write_summary(queue, plugin_data_summary(tag, text).SerializeToString(), step)
        elif file_writer is not None:
            file_writer.add_summary(plugin_data_summary(tag, text), step)
        else:
            logger.experiment.add_text(tag, text, global_step=step)


def _torch_file_writer(writer: Any) -> Optional[FileWriter]:
    """The ``FileWriter`` of torch under ``writer`` (it takes TensorBoard's protos), or None (tensorboardX's)."""
    file_writer = getattr(writer, "file_writer", None)
    if file_writer is None and isinstance(writer, SummaryWriter):
        file_writer = writer._get_file_writer()  # reopened after `close()`, as its own `add_*` methods do
    return file_writer if isinstance(file_writer, FileWriter) else None


Charts = Mapping[str, Sequence[str]]
"""Custom-scalars charts: each chart's title and the tag regexes whose series it draws."""

# The layout each TensorBoard writer has been given so far, by category: callbacks add to it.
_LAYOUTS: WeakKeyDictionary[Any, dict[str, dict[str, list[str]]]] = WeakKeyDictionary()


def log_layout(trainer: pl.Trainer | Any, categories: Mapping[str, Charts], step: int) -> None:
    """Add charts to the TensorBoard Custom Scalars layout of every TensorBoardLogger, from rank zero.

    TensorBoard serves the last layout written to a run, so each writer keeps the union of
    every category given to it so far, and each call that adds a chart writes that whole union
    once: several callbacks add to one layout instead of replacing each other's, and a chart
    added mid-run (one that has data only from then on) comes with a rewrite. A call that adds
    nothing writes nothing. Each chart draws every scalar whose tag a regex matches from its
    start (``re.match``); a logger's ``prefix`` is put in front of the regexes, as it is in
    front of the tags, and of the category title.

    With several runs in one log dir TensorBoard merges their layouts by category title, run
    by run in name order, and drops the charts a run adds to a category that first came from
    a run other than the first (TensorBoard 2.21's ``layout_impl`` files them under the source
    run's copy, not the merged one). So the written title names the category's charts
    (:func:`category_title`): runs whose layouts share a title have the same charts, a run with
    other charts gets a category of its own, and every chart survives the merge.

    Args:
        trainer: The trainer whose loggers receive the layout.
        categories: Charts by category, e.g.
            ``{"activations": {"std by layer": [r"activations/.*/std$"]}}``.
        step: The global step to write the layout at.
    """
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if not isinstance(logger, TENSORBOARD_LOGGERS):
            continue
        lead = f"{logger._prefix}{logger.LOGGER_JOIN_CHAR}" if logger._prefix else ""
        layout = _LAYOUTS.setdefault(logger.experiment, {})
        before = {name: dict(charts) for name, charts in layout.items()}
        for name, charts in categories.items():
            if charts:
                layout.setdefault(name, {}).update(
                    {chart: [re.escape(lead) + r for r in tags] for chart, tags in charts.items()})
        if layout == before:
            continue
        spec = {category_title(lead + name, charts): {chart: ["Multiline", tags] for chart, tags in charts.items()}
                for name, charts in layout.items()}
        queue = event_queue_of(logger)
        if queue is not None:
            write_summary(queue, custom_scalars(spec).SerializeToString(), step)
        else:  # the public method, same layout (at step 0)
            logger.experiment.add_custom_scalars(spec)


def category_title(name: str, charts: Iterable[str]) -> str:
    """A Custom Scalars category title that names its charts, runs of ``"<x> by <y>"`` shortened.

    Example::

        category_title("activations", ["mean by layer", "std by layer"])  # 'activations: mean, std by layer'
        category_title("gradients", ["norm by parameter", "total norm"])  # 'gradients: norm by parameter, total norm'
    """
    parts: list[tuple[str, str]] = []  # (what, by what) per chart; consecutive charts by the same share it
    for chart in charts:
        what, by, per = chart.rpartition(" by ")
        what, per = (what, per) if by else (per, "")
        if parts and per and parts[-1][1] == per:
            parts[-1] = (f"{parts[-1][0]}, {what}", per)
        else:
            parts.append((what, per))
    return f"{name}: " + ", ".join(f"{what} by {per}" if per else what for what, per in parts)
