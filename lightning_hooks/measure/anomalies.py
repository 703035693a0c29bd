"""Gradient anomaly kernels and state: norms, flags, the running median.

The kernels are pure tensor functions that never leave the device (the norms,
:func:`gradient_figures`, are in ``_gradient_figures``); :class:`AnomalyDetector` holds the
thresholds and the running median window that the callbacks share. The report of an
anomalous step, :class:`AnomalyReport`, is in ``_anomaly_report``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hooks.core._validation import MAX_WINDOW, check_bool, check_int, check_number
from lightning_hooks.measure._gradient_figures import GradientFigures, gradient_figures

__all__ = [
    "FLAG_NAMES", "AnomalyDetector", "GradientFigures", "anomaly_flags", "gradient_figures",
]

#: Anomaly flags, in the order of the rows of :func:`anomaly_flags`.
FLAG_NAMES = ("nonfinite", "exploding", "vanishing")


@torch.no_grad()
def anomaly_flags(
    group_norms: Tensor,
    nonfinite: Tensor,
    *,
    check_finite: bool = True,
    norm_threshold: Optional[float] = None,
    min_norm: Optional[float] = None,
    relative_threshold: Optional[float] = None,
    reference: Optional[Tensor] = None,
) -> Tensor:
    """Anomaly flags from the figures of :func:`gradient_figures`, on device.

    A column (group or total) whose gradients are not all finite is flagged ``nonfinite`` and
    never ``exploding`` or ``vanishing``; with ``check_finite=False`` it is flagged
    ``exploding`` instead, if ``norm_threshold`` or ``relative_threshold`` is set, so that a NaN never
    passes a norm check unseen. A NaN norm (a group without gradients) or a NaN reference
    flags nothing.

    Args:
        group_norms: Norms per group and in total, as in :class:`GradientFigures`.
        nonfinite: Non-finite gradient counts per group and in total.
        check_finite: Flag non-finite gradients ``nonfinite`` (else ``exploding``, see above).
        norm_threshold: Flag ``exploding`` above this norm.
        min_norm: Flag ``vanishing`` below this norm.
        relative_threshold: Flag ``exploding`` above this multiple of ``reference``.
        reference: The running median norm per column; None before there is one.

    Returns:
        Bool tensor of shape ``(len(FLAG_NAMES), len(group_norms))``, rows in ``FLAG_NAMES``
        order.

    Example::

        flags = anomaly_flags(figures.group_norms, figures.nonfinite, norm_threshold=1e3)
        any_exploding = flags[FLAG_NAMES.index("exploding")].any()

    """
    return _flag_rows(group_norms, nonfinite == 0, check_finite, norm_threshold, min_norm, relative_threshold,
                      reference)


def _flag_rows(group_norms: Tensor, finite: Tensor, check_finite: bool, norm_threshold: Optional[float],
               min_norm: Optional[float], relative_threshold: Optional[float], reference: Optional[Tensor]) -> Tensor:
    """:func:`anomaly_flags` from whether each column is finite; a flag no threshold enables costs no operation."""
    never = torch.zeros_like(finite)
    exploding = never
    if norm_threshold is not None:
        exploding = exploding | (group_norms > norm_threshold)
    if relative_threshold is not None and reference is not None:
        exploding = exploding | (group_norms > relative_threshold * reference.to(group_norms))
    vanishing = group_norms < min_norm if min_norm is not None else never
    if check_finite:
        return torch.stack([~finite, _where_finite(exploding, finite, never), _where_finite(vanishing, finite, never)])
    if norm_threshold is not None or relative_threshold is not None:
        exploding = exploding | ~finite
    return torch.stack([never, exploding, _where_finite(vanishing, finite, never)])


def _where_finite(flag: Tensor, finite: Tensor, never: Tensor) -> Tensor:
    return never if flag is never else flag & finite


@dataclass
class AnomalyDetector:
    """Thresholds for gradient anomaly flags, and the running median norm that they compare with.

    The median is over the group and total norms of the last ``window`` steps that were not
    anomalous (a run of bad steps does not drag it up), kept per optimizer on device; the
    relative check starts once the window is full. A non-finite norm is never stored (it is
    kept as a gap, which the median skips).

    Args:
        check_finite: Flag gradients that hold a NaN or an Inf as nonfinite; when off, they
            count as exploding if ``norm_threshold`` or ``relative_threshold`` is set.
        norm_threshold: Flag a group or total norm above this as exploding.
        relative_threshold: Flag a norm above this multiple of its running median as exploding.
        min_norm: Flag a group or total norm below this as vanishing.
        window: How many clean steps the running median covers.

    Raises:
        ValueError: For a threshold that is not a finite positive number (``relative_threshold``
            must be > 1), ``min_norm >= norm_threshold``, or ``window`` < 1.
        TypeError: For a ``check_finite`` that is not a bool, a threshold that is not a number, or
            a ``window`` that is not an int.

    """

    check_finite: bool = True
    norm_threshold: Optional[float] = None
    relative_threshold: Optional[float] = None
    min_norm: Optional[float] = None
    window: int = 50

    def __post_init__(self) -> None:
        check_bool("check_finite", self.check_finite)
        check_number("norm_threshold", self.norm_threshold, 0.0, optional=True)
        check_number("min_norm", self.min_norm, 0.0, optional=True)
        check_number("relative_threshold", self.relative_threshold, 1.0, optional=True)
        if self.min_norm is not None and self.norm_threshold is not None and self.min_norm >= self.norm_threshold:
            raise ValueError(f"`min_norm` ({self.min_norm}) must be below `norm_threshold` ({self.norm_threshold}):"
                             " a norm cannot be both vanishing and exploding; lower one of them")
        check_int("window", self.window, high=MAX_WINDOW)
        self._history: dict[int, Tensor] = {}
        self._seen: dict[int, int] = {}
        # Read at every step by both gradient callbacks: made once (the settings are fixed once validated).
        exploding = self.norm_threshold is not None or self.relative_threshold is not None
        enabled = (self.check_finite, exploding, self.min_norm is not None)
        self._enabled = tuple(name for name, on in zip(FLAG_NAMES, enabled) if on)
        self._shares = None if self.relative_threshold is not None else (
            self.check_finite, self.norm_threshold, self.min_norm)

    @property
    def enabled_flags(self) -> tuple[str, ...]:
        """The flags these settings can raise."""
        return self._enabled

    @property
    def shares_flags(self) -> Optional[tuple[Any, ...]]:
        """What this detector's flags depend on besides the figures; None when that is its own running median.

        Two detectors with the same value flag the same figures alike: a step computes their flags once.
        """
        return self._shares

    def flags(self, figures: GradientFigures, key: int = 0) -> Tensor:
        """:func:`anomaly_flags` for one optimizer (``key``) against its running median."""
        history = self._history.get(key)
        shape = (self.window, figures.group_norms.numel())
        reference = None
        if history is not None and history.shape == shape and self._seen[key] >= self.window:
            reference = history.nanmedian(0).values
        return _flag_rows(figures.group_norms, figures.finite, self.check_finite, self.norm_threshold, self.min_norm,
                          self.relative_threshold, reference)

    def remember(self, group_norms: Tensor, key: int = 0) -> None:
        """Add a clean step's norms to the window of optimizer ``key``; on device, no sync."""
        if self.relative_threshold is None:
            return
        history = self._history.get(key)
        if history is None or history.shape != (self.window, group_norms.numel()):
            history = torch.full((self.window, group_norms.numel()), math.nan, dtype=torch.float64,
                                 device=group_norms.device)
            self._seen[key] = 0
        self._history[key] = history = history.to(group_norms.device)
        history[self._seen[key] % self.window] = torch.where(group_norms.isfinite(), group_norms, math.nan)
        self._seen[key] += 1

    def state_dict(self) -> dict[str, Any]:
        """Return the running windows, on the CPU."""
        return {"history": {k: h.cpu() for k, h in self._history.items()}, "seen": dict(self._seen)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the running windows; they move to the gradients' device at the next step."""
        self._history = {int(k): h.clone() for k, h in state_dict["history"].items()}
        self._seen = {int(k): int(n) for k, n in state_dict["seen"].items()}
