"""Callbacks that receive, on the host, the figures the monitors log, as typed records (``figures``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_hooks.output.figures import HistogramBlock, ScalarBlock


class FigureListener:
    """Mixin for a callback that is handed every step's logged figures (no device work, no host sync).

    The sinks call these on rank zero with what they write: the figures are already on the host.
    A listener reads the typed records (:meth:`record_figures`, :meth:`record_histograms`):
    kind, statistic and row name are fields, never parsed out of a tag.
    """

    def record_figures(self, figures: Sequence[ScalarBlock], metrics: Mapping[str, float], step: int) -> None:
        """Receive the scalars logged at ``step``: the rows' as typed blocks, and every one by tag.

        Args:
            figures: One block per kind and statistic (``activations``/``std``, ``gradients``/``norm``...).
            metrics: Every scalar logged at ``step`` by its tag, the rows' and the others
                (``gradients/total_norm``, ``anomalies/<flag>``).
            step: The step they are logged at.

        By default hands ``metrics`` to :meth:`record_scalars`.
        """
        self.record_scalars(metrics, step)

    def record_scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """Receive every scalar logged at ``step``, by tag (for a listener that wants the tags only)."""

    def record_histograms(self, histograms: HistogramBlock, edges: Sequence[float], step: int) -> None:
        """Receive the histograms of one kind logged at ``step``, one row each, on shared ``edges``."""
