"""Callbacks that receive, on the host, the figures the monitors log, as the sinks write them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Histogram = tuple[str, Mapping[str, float], Sequence[float]]
"""One histogram: its tag, a summary with ``count_finite``, ``min``, ``max``, ``sum`` and
``sum_sq`` of the values, and the count per bin."""


class FigureListener:
    """Mixin for a callback that is handed every step's logged figures (no device work, no host sync).

    The sinks call these on rank zero with what they write: the figures are already on the host.
    """

    def record_scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """Receive the scalars logged at ``step``."""

    def record_histograms(self, histograms: Sequence[Histogram], edges: Sequence[float], step: int) -> None:
        """Receive the histograms logged at ``step``, ``(tag, summary, counts)`` each, on shared ``edges``."""


def listeners(trainer: Any) -> list[FigureListener]:
    """The trainer's callbacks that listen to the logged figures."""
    return [cb for cb in getattr(trainer, "callbacks", ()) if isinstance(cb, FigureListener)]
