"""Spike detection on the loss, the gradient norm and the update norm: a robust z-score over a window, on device.

:func:`robust_zscore` is the kernel (pure tensors in, a tensor out); :class:`SpikeTrigger` holds
the thresholds a user sets; :class:`SpikeWindows` keeps the rolling windows of one run on the
device, one per signal and optimizer, and judges each new value against them without a host sync.
The windows keep their rows in a :class:`~lightning_hooks.measure._device_ring.DeviceRing`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_hooks.core._validation import check_int, check_number
from lightning_hooks.measure._device_ring import DeviceRing

__all__ = ["SPIKE_SIGNALS", "SpikeTrigger", "SpikeWindows", "level_deviation", "robust_zscore"]

#: The signals a :class:`SpikeTrigger` watches, in the order of its flags: the flag names are ``<signal>_spike``.
SPIKE_SIGNALS = ("loss", "grad_norm", "update_norm")

#: The fewest and the most values a spike window may hold: a median and a spread of fewer than 8
#: values call ordinary noise a spike (window=2 flagged 57-72% of a healthy run's steps); a median
#: over more than 10,000 is a sort of that many values at every step, and takes thousands of steps
#: to accept a new level.
MIN_WINDOW, MAX_WINDOW = 8, 10_000

#: The update norm's smallest spread (of its log): an optimizer's update is smoothed by its moments, so
#: its step-to-step changes are small while healthy small-batch runs still see it double at times
#: (measured on the fault zoo's healthy recipes, 300 steps: x2.1 above its recent level for the MLP
#: under Adam, x4.4 for the CNN under SGD with momentum, x1.4 for the GPT-2 under AdamW). At 0.3 and
#: z 6, a x10 learning rate for one step (log 2.3, z 7.7) is flagged and those are not (z 2.5, 4.9).
UPDATE_MIN_SPREAD = 0.3

#: MAD times this is the standard deviation of normally distributed values: a z of 6 means what it does for a std.
_MAD_TO_STD = 1.4826

#: The quantile of a signal's absolute deviations its spread is judged by, and what turns it into a standard
#: deviation for normal values (their 90th percentile is 1.645 of it). The 90th, not the upper quartile:
#: a heavy tail (a classifier's batch loss near 100% train accuracy) shows further out, where the quartile
#: misses it. On 70 healthy recipes (``benchmarks/spikes_models.py``) it halves the false flags
#: (36 -> 20 steps after the first 10%; the ViT's loss 24 -> 9), the real spikes of ``benchmarks/spikes_healthy.py``
#: caught as soon (``benchmarks/spikes_variants.py``).
TAIL_QUANTILE, _TAIL_TO_STD = 0.9, 1 / 1.6449


@torch.no_grad()
def robust_zscore(window: Tensor, value: Tensor, min_spread: Union[float, Tensor] = 0.0, recent: int = 8,
                  deviations: Optional[Tensor] = None) -> Tensor:
    """How many robust standard deviations ``value`` is above the recent level of ``window``, on device.

    A signal whose values (the window's and ``value``) are all positive is judged on a log
    scale: a loss near convergence wanders by factors (a minibatch 4x the median is ordinary
    at 1e-4), and a spike is a factor too. A signal that is ever 0 or negative is judged as it
    is. The level is the median of the last ``recent`` values; the spread is the median of the
    absolute differences between successive values, times 1.4826 / sqrt(2) (the standard
    deviation for normal noise), so that a trend (a loss falling 1000x in the window) widens
    neither: a spike is a jump from where the signal was, not from where it was 100 steps ago.
    With ``deviations`` (each past value's own distance from the level it was judged against,
    :func:`level_deviation`), the spread is at least their 90th percentile, over 1.645 (the
    standard deviation for normal noise, where the two agree; :data:`TAIL_QUANTILE`): a heavy-tailed signal (a
    classifier's batch loss near convergence, where one misclassified sample dominates a batch;
    a momentum optimizer's update after it) widens its own spread. The spread is at least
    ``min_spread`` (on the log scale, where 0.05 is about a 5% change; on the linear one, times
    the level's magnitude), so that a signal that has flattened out (full batch) does not call
    a wobble a spike. NaNs in ``window`` and ``deviations`` are gaps and skipped.

    Args:
        window: The past values along dim 0, oldest first: ``(W,)``, or ``(W, S)`` for ``S``
            signals at once.
        value: The new value: a 0-d tensor, or ``(S,)``.
        min_spread: The smallest spread (of the log, or as a fraction of the level): one, or one per signal.
        recent: How many of the last values the level is the median of.
        deviations: The past values' deviations from their levels, of the shape of ``window``
            (used for a signal on the log scale only), or None.

    Returns:
        Float64, of the shape of ``value``: 0 where the window holds no value (or a constant
        and ``min_spread`` is 0), +inf for a non-finite ``value``.

    Example::

        z = robust_zscore(torch.tensor([1.0, 1.1, 0.9, 1.0]), torch.tensor(3.0), min_spread=0.05)  # about 10
    """
    both = torch.cat([window.double(), value.double().unsqueeze(0)])  # the window, then the value: one log
    log = ~(both <= 0).any(0)  # per signal: on the log scale (a NaN is a gap, not a sign)
    both = torch.where(log, both.clamp(min=0).log(), both)
    window, value = both[:-1], both[-1]
    level = window[-recent:].nanmedian(0).values
    steps = (window[1:] - window[:-1]).abs().nanmedian(0).values * (_MAD_TO_STD / math.sqrt(2))
    if deviations is not None:
        tail = deviations.double().abs().nanquantile(TAIL_QUANTILE, 0) * _TAIL_TO_STD  # NaN: none yet
        steps = torch.where(log & (tail > steps), tail, steps)
    spread = torch.maximum(steps, torch.where(log, min_spread, level.abs() * min_spread))
    z = torch.where(spread > 0, (value - level) / spread, 0.0)  # no spread (or no value, NaN): no verdict
    return torch.where(value.isfinite(), z, math.inf)


@torch.no_grad()
def level_deviation(window: Optional[Tensor], value: Tensor, recent: int = 8) -> Tensor:
    """How far ``value`` lies from the median of the last ``recent`` values of ``window``, in log.

    What :func:`robust_zscore` measures a new value against, for the ``deviations`` it judges
    the spread by. NaN for a signal whose value or recent values are not all positive, or
    without a value yet.

    Args:
        window: The past values, oldest first: ``(W, S)``, or None (none yet).
        value: The new value, ``(S,)``.
        recent: How many of the last values the level is the median of.

    Returns:
        Float64, of the shape of ``value``.

    Example::

        level_deviation(torch.tensor([[1.0], [2.0], [4.0]]), torch.tensor([8.0]), recent=2)  # log(8 / 3)
    """
    value = value.double()
    if window is None or len(window) == 0:
        return torch.full_like(value, math.nan)
    last = window[-recent:].double()
    positive = (value > 0) & ~(last <= 0).any(0)
    level = last.clamp(min=1e-300).log().nanmedian(0).values
    return torch.where(positive, value.clamp(min=1e-300).log() - level, math.nan)


@dataclass(frozen=True)
class SpikeTrigger:
    """When a step's loss, gradient norm or update norm is a spike: a robust z-score above a threshold.

    The z-score of a step's value is how far it lies above the signal's recent level (the median
    of the last ``window // 8`` values, at least 8), in robust standard deviations of its
    step-to-step changes over the last ``window`` values, or of its past values' deviations from
    their levels where those are wider (a heavy-tailed signal), on a log scale for a signal that
    is positive (see :func:`robust_zscore`). No signal is judged before its window holds ``warmup``
    finite values (a NaN step is a gap). Every step's finite value joins the window after it is
    judged, a spike's too.

    Why these defaults: OLMo-core's ``SkipStepOptimizer`` skips a step whose loss or gradient
    norm is more than 6 standard deviations above the mean of the last 128 steps, and judges
    nothing before 64 (half the window); the same numbers here mean the same for normal noise.
    Medians replace the mean and the standard deviation because a spike in the window would
    inflate the standard deviation for the next 128 steps and hide the next spike. The log
    scale, because a small-batch loss near convergence wanders by factors (at 1e-4, a batch at
    4x the median is ordinary: 6 MADs and more on the linear scale, 2 to 4 on the log scale),
    while a spike is a large factor at any level. The spread from step-to-step changes and the
    level from the last steps, because early in training the loss falls 1000x within a window:
    measured around the window's median, a x1000 spike there is 2 spreads high; measured from
    where the loss just was, 40. A lasting change of level becomes the new normal once it fills
    half of the recent steps. The spread is at least ``min_spread`` (5%, on the log scale), so
    that a signal that has flattened out or moves smoothly (full batch) does not call a wobble a
    spike. Measured on healthy and faulty runs: ``benchmarks/spikes_healthy.py``.

    Args:
        loss: Flag ``loss_spike`` above this z-score (None: do not watch the loss).
        grad_norm: Flag ``grad_norm_spike`` above this z-score of the total gradient norm (None:
            do not watch it).
        update_norm: Flag ``update_norm_spike`` above this z-score of the total update norm
            ``||w_after - w_before||`` over the optimizer's parameters (None, the default: do
            not watch it). An Adam update-norm spike can come before the loss spikes (a 32B
            run's retrospective, Marin). It costs one device copy of the parameters per step
            (shared with UpdateTransform and GradientMonitor's ``update_ratio``). An update is
            known only once made: a step's update is judged at the next step's check, which the
            flag fires at. Its spread is at least :data:`UPDATE_MIN_SPREAD`.
        window: How many past steps the median covers: 8 to 10,000.
        warmup: How many finite values a signal's window must hold before it is judged: 8 to
            ``window`` (None: half the window, 64 by default).
        min_spread: The smallest spread: of the log, or, for a signal that is not positive, as a
            fraction of the median (the update norm's is at least :data:`UPDATE_MIN_SPREAD`, 0.3).

    Raises:
        TypeError: For a threshold or ``min_spread`` that is not a number, or a ``window`` or
            ``warmup`` that is not an int.
        ValueError: For a threshold that is not finite and > 0, no signal watched, a
            ``window`` outside [8, 10000], a ``warmup`` below 8 or above ``window``, or a
            ``min_spread`` outside [0, 1].

    Example::

        from lightning_hooks import GradientAnomalyStopping, SpikeTrigger

        stopper = GradientAnomalyStopping(action="rollback", skip_batches=50, spikes=SpikeTrigger())
    """

    loss: Optional[float] = 6.0
    grad_norm: Optional[float] = 6.0
    update_norm: Optional[float] = None
    window: int = 128
    warmup: Optional[int] = None
    min_spread: float = 0.05

    def __post_init__(self) -> None:
        check_number("loss", self.loss, low=0, optional=True)
        check_number("grad_norm", self.grad_norm, low=0, optional=True)
        check_number("update_norm", self.update_norm, low=0, optional=True)
        if self.loss is None and self.grad_norm is None and self.update_norm is None:
            raise ValueError("SpikeTrigger watches nothing: set `loss`, `grad_norm` or `update_norm` (z-scores,"
                             " e.g. 6.0)")
        check_int("window", self.window)
        if not MIN_WINDOW <= self.window <= MAX_WINDOW:
            raise ValueError(f"`window` must be an int in [{MIN_WINDOW}, {MAX_WINDOW}], got {self.window!r}: a median"
                             f" and a spread of fewer than {MIN_WINDOW} values call ordinary noise a spike; pass"
                             " e.g. window=128 (the default)")
        check_int("warmup", self.warmup, optional=True, none_means="half the window")
        warmup = max(MIN_WINDOW, self.window // 2) if self.warmup is None else self.warmup  # half, as OLMo-core
        if warmup < MIN_WINDOW:
            raise ValueError(f"`warmup` must be at least {MIN_WINDOW} (or None for half the window), got {warmup!r}:"
                             f" no step is judged on fewer than {MIN_WINDOW} values; pass warmup={MIN_WINDOW} or more")
        if warmup > self.window:
            raise ValueError(f"`warmup` ({warmup}) must not exceed `window` ({self.window}): the window"
                             " could never hold enough values")
        object.__setattr__(self, "warmup", warmup)
        check_number("min_spread", self.min_spread, low=0, strict=False, high=1)

    @property
    def spreads(self) -> tuple[float, ...]:
        """The smallest spread per signal of :data:`SPIKE_SIGNALS`."""
        return self.min_spread, self.min_spread, max(self.min_spread, UPDATE_MIN_SPREAD)

    @property
    def thresholds(self) -> tuple[float, ...]:
        """The threshold per signal of :data:`SPIKE_SIGNALS`, +inf for a signal not watched."""
        return tuple(math.inf if t is None else float(t) for t in (self.loss, self.grad_norm, self.update_norm))


class SpikeWindows:
    """The rolling windows of a :class:`SpikeTrigger`, per optimizer, on device.

    Each row holds a step's values and, beside them, each value's deviation from the level it
    would have been judged against (:func:`level_deviation`; NaN for a value flagged as a spike:
    no healthy excursion): the spread of a heavy-tailed signal is judged by them (:func:`robust_zscore`).

    Args:
        trigger: The thresholds and the window's size.
    """

    def __init__(self, trigger: SpikeTrigger) -> None:
        self.trigger = trigger
        self._rings: dict[int, DeviceRing] = {}
        self._thresholds: Optional[Tensor] = None  # on the values' device, made once
        self._spreads: Optional[Tensor] = None  # likewise
        self._warmup: int = trigger.warmup if trigger.warmup is not None else 1
        self._recent = max(MIN_WINDOW, trigger.window // 8)  # the level is the median of this many last values
        self._flagged: dict[int, Tensor] = {}  # the flags of each optimizer's last judged values, until remembered

    def judge(self, values: Tensor, key: int = 0) -> tuple[Tensor, Tensor]:
        """The z-score of each signal's value (loss, grad norm) and whether it is a spike, on device.

        Args:
            values: The step's loss, total gradient norm and the step before's update norm
                (NaN: none), or the first of them.
            key: The optimizer's index.

        Returns:
            ``(z, flags)``: float64 z-scores (0 until the signal's window holds ``warmup`` finite
            values) and bool flags, both of the shape of ``values``.
        """
        ring = self._rings.get(key)
        values = values.double()
        if self._thresholds is None or self._thresholds.device != values.device:
            self._thresholds = torch.tensor(self.trigger.thresholds, dtype=torch.float64, device=values.device)
            self._spreads = torch.tensor(self.trigger.spreads, dtype=torch.float64, device=values.device)
        signals = values.numel()  # the first signals of SPIKE_SIGNALS, if not all
        rows = ring.ordered() if ring is not None and ring.count >= self._warmup else None
        if rows is not None and rows.shape[1] != 2 * signals:  # saved with other signals: a new window
            rows = None
        if rows is None:
            z = torch.zeros_like(values)
        else:
            rows = rows.to(values.device)  # moved once, at push
            assert self._spreads is not None
            z = robust_zscore(rows[:, :signals], values, self._spreads[:signals], self._recent,
                              deviations=rows[:, signals:])
            warm = rows[:, :signals].isfinite().sum(0) >= self._warmup  # in finite values: a NaN step is a gap
            z = torch.where(values.isnan() | ~warm, 0.0, z)  # a signal without a value, or too few: no verdict
        flags = z > self._thresholds[:signals]
        self._flagged[key] = flags  # a spike's deviation is no healthy excursion: it stays out of the spread
        return z, flags

    def remember(self, values: Tensor, key: int = 0) -> None:
        """Add the step's values to the windows of optimizer ``key`` (a non-finite one as a gap)."""
        ring = self._rings.setdefault(key, DeviceRing(self.trigger.window))
        values = values.double().reshape(-1)
        values = torch.where(values.isfinite(), values, math.nan)
        rows = ring.ordered()
        if rows is not None and rows.shape[1] != 2 * values.numel():
            rows = None  # other signals: the ring starts again
        past = None if rows is None else rows[:, :values.numel()].to(values.device)
        deviation = level_deviation(past, values, self._recent)
        flagged = self._flagged.pop(key, None)
        if flagged is not None and flagged.shape == deviation.shape:
            deviation = torch.where(flagged, math.nan, deviation)
        ring.push(torch.cat([values, deviation]))  # a row: the values, then their deviations

    def state_dict(self) -> dict[int, Any]:
        """The windows, on the CPU, by optimizer."""
        return {key: ring.state_dict() for key, ring in self._rings.items()}

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._rings, self._flagged = {}, {}
        for key, ring_state in state.items():
            ring = self._rings[int(key)] = DeviceRing(self.trigger.window)
            ring.load_state_dict(ring_state)
