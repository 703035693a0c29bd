"""ActivationMonitor's rows as figures: which stat each row logs when, their tags, charts and histograms."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Optional

import lightning.pytorch as pl
import numpy as np
from torch import Tensor

from lightning_hooks.callbacks._activation_grads import GRAD_PREFIX
from lightning_hooks.core._compat import callbacks_of
from lightning_hooks.measure._stat_rows import DEFAULT_STATS, DIVERGENCE_STATS, N_FIELDS, summarize_rows
from lightning_hooks.measure.aggregate import StatBlock
from lightning_hooks.output._histograms import log_histograms
from lightning_hooks.output._plugin_data import FORWARD_ORDER_TAG, LOOKUPS_TAG
from lightning_hooks.output.figures import FigureListener, HistogramBlock, ScalarBlock
from lightning_hooks.output.sinks import Charts, log_layout, log_plugin_data, log_scalars

#: Default stats logged only where they say something: ``zero_fraction`` from a module's first
#: exact zero on, ``nonfinite_fraction`` while it is not zero (and once more at 0).
_SPARSE = ("zero_fraction", "nonfinite_fraction")


class ActivationFigures:
    """What ActivationMonitor logs of its rows, and what decides it; made afresh for each fit.

    Stats are logged at every logged step (``always``), from a module's first exact zero on
    (``from_first_zero``: the default ``zero_fraction``), or only while not zero
    (``while_nonzero``: ``nonfinite_fraction`` and the NaN and Inf counts), so that a healthy
    run's charts hold only what says something.

    Args:
        stats: ActivationMonitor's ``stats`` (None: the defaults).
        histogram: Whether the histograms are written.
    """

    def __init__(self, stats: Optional[Sequence[str]], histogram: bool) -> None:
        self.always = tuple(s for s in DEFAULT_STATS if s not in _SPARSE) if stats is None else tuple(stats)
        self.from_first_zero = ("zero_fraction",) if stats is None else ()
        self.while_nonzero = tuple(s for s in (*_SPARSE[1:], *DIVERGENCE_STATS)
                                   if s not in self.always and (stats is None or s in DIVERGENCE_STATS))
        self.histogram = histogram
        self._zeroed: dict[str, np.ndarray] = {}  # by prefix, per module: whether it has output an exact zero
        # By prefix and stat, per module: logged only while not zero, and not zero when last logged.
        self._diverged: dict[str, dict[str, np.ndarray]] = {}
        self._nonfinite_seen: set[str] = set()  # prefixes under which a non-finite value was logged
        self._tag_cache: dict[str, dict[str, list[str]]] = {}  # by prefix: every tag, made once per fit

    @property
    def tags_per_row(self) -> int:
        """The most tags one row writes: its scalars (``nonfinite_fraction`` of the sparse ones) and histogram."""
        return len(self.always + self.from_first_zero) + ("nonfinite_fraction" in self.while_nonzero) + self.histogram

    def charts(self, prefix: str) -> dict[str, Charts]:
        """The Custom Scalars charts under ``prefix`` that have data: one per stat, each drawing every module.

        Those logged at every step from the start; ``zero_fraction`` once a module had a zero;
        those logged only while not zero, in a category of their own, once one was.
        """
        zeroed = self._zeroed.get(prefix)
        stats = self.always + (self.from_first_zero if zeroed is not None and zeroed.any() else ())
        charts = {f"{stat} by layer": [rf"{prefix}/.*/{stat}$"] for stat in stats}
        nonfinite: dict[str, list[str]] = {}
        if prefix in self._nonfinite_seen:
            nonfinite = {f"{stat} by layer": [rf"{prefix}/.*/{stat}$"]
                         for stat in self.while_nonzero if stat not in DIVERGENCE_STATS}
            counters = [s for s in self.while_nonzero if s in DIVERGENCE_STATS]
            if counters:
                nonfinite["non-finite counts by layer"] = [rf"{prefix}/.*/({'|'.join(counters)})$"]
        return {prefix: charts, f"{prefix}, non-finite": nonfinite}

    def log_block(self, trainer: pl.Trainer, block: StatBlock, prefix: str, grads: int, step: int,
                  order: Sequence[str] = (), carried: Sequence[tuple[Tensor, ScalarBlock]] = (),
                  lookups: Optional[Mapping[str, str]] = None) -> None:
        """Drain ``block`` (one transfer) and log its rows at ``step`` from rank zero.

        Args:
            trainer: The Trainer whose loggers write.
            block: The step's rows: the forward's, then ``grads`` output-gradient rows.
            prefix: The forward rows' tag prefix (``activations`` or ``val_activations``).
            grads: How many of the last rows are output gradients, logged under ``activation_grads``.
            step: The log step.
            order: The modules in the order their hooks first fired, once per fit: given to the
                figure listeners before the figures (LayerHealth judges in this order) and written
                for the Layers tab after them (a JSON list of names); empty: nothing to tell.
            carried: Other callbacks' figures of the step on device (:meth:`ActivationMonitor.carry`),
                each with the block it is logged as (its values taken from the device's), brought
                over in the same transfer and logged in the same event.
            lookups: The watched embeddings and their weights' rows, written with ``order`` for the Layers tab's
                judge (a JSON object).
        """
        # The forward's rows and the gradients', and whatever was carried, in one transfer.
        rows, values = block.drain_with(trainer, [device for device, _ in carried])
        if not trainer.is_global_zero:
            return
        for listener in callbacks_of(trainer, FigureListener) if order else ():
            listener.record_forward_order(list(order))
        forward = len(block.names) - grads
        figures = self.log_rows(trainer, rows[:forward], block.names[:forward], prefix, step, block.edges)
        if grads:
            figures += self.log_rows(trainer, rows[forward:], block.names[forward:], GRAD_PREFIX, step, block.edges)
        for _, figure in carried:
            figures.append(figure._replace(values=values[:len(figure.rows)]))
            values = values[len(figure.rows):]
        log_scalars(trainer, {}, step, figures)
        if order:
            log_plugin_data(trainer, FORWARD_ORDER_TAG, json.dumps(list(order)), step)
            log_plugin_data(trainer, LOOKUPS_TAG, json.dumps(dict(lookups or {})), step)

    def log_rows(self, trainer: pl.Trainer, rows: np.ndarray, names: list[str], prefix: str,
                 step: int, edges: Sequence[float]) -> list[ScalarBlock]:
        """Log the histograms (and any new chart) of ``rows`` under ``prefix``; return their scalars."""
        summary = summarize_rows(rows)
        called = summary["calls"] != 0
        tags = self._tags(prefix, names)
        figures = [ScalarBlock.where(prefix, stat, names, tags[stat], summary[stat], called) for stat in self.always]
        if self.from_first_zero:  # zero_fraction from a module's first exact zero on
            zeroed = self._zeroed.get(prefix, np.zeros(len(names), dtype=bool))
            self._zeroed[prefix] = zeroed = zeroed | (called & (summary["zero_fraction"] > 0))
            figures.append(ScalarBlock.where(prefix, "zero_fraction", names, tags["zero_fraction"],
                                             summary["zero_fraction"], called & zeroed))
        # The stats logged only while not zero: those not zero now, and those due since the last
        # logged step; those not zero now are due at the next one, and one due but not logged now
        # (its module was not called) stays due.
        due = self._diverged.setdefault(prefix, {})
        for stat in self.while_nonzero:
            nonzero, was_due = called & (summary[stat] > 0), due.get(stat, np.zeros(len(names), dtype=bool))
            logged = nonzero | (called & was_due)
            figures.append(ScalarBlock.where(prefix, stat, names, tags[stat], summary[stat], logged))
            due[stat] = nonzero | (was_due & ~called)
            if due[stat].any():
                self._nonfinite_seen.add(prefix)
        log_layout(trainer, self.charts(prefix), step)  # writes only when a chart has its first figure
        if self.histogram:
            shown = np.flatnonzero(called)
            index = shown.tolist()
            log_histograms(trainer, HistogramBlock(prefix, [names[i] for i in index], [tags[""][i] for i in index],
                                                   {k: v[shown] for k, v in summary.items()},
                                                   rows[shown, N_FIELDS:]), edges, step)
        return figures

    def _tags(self, prefix: str, names: list[str]) -> dict[str, list[str]]:
        """Every tag of ``prefix`` by stat (``""``: the histogram's), one per module, made once per fit."""
        found = self._tag_cache.get(prefix)
        if found is None:
            stats = ("", *self.always, *self.from_first_zero, *self.while_nonzero)
            found = self._tag_cache[prefix] = {
                stat: [f"{prefix}/{name}/{stat}" if stat else f"{prefix}/{name}" for name in names] for stat in stats}
        return found
