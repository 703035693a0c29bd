"""LayerHealth: each layer's health at a glance, drawn from the figures the monitors already log."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hooks._listeners import FigureListener
from lightning_hooks.activations import ActivationMonitor
from lightning_hooks.gradients import GradientMonitor
from lightning_hooks.sinks import log_text

if TYPE_CHECKING:
    from lightning_hooks._health_plots import Column, Profile
    from lightning_hooks.sinks import Histogram

#: The figures kept per layer, as (tag prefix, stat), e.g. ``activations/<module>/zero_fraction``.
WATCHED = (("activations", "std"), ("activations", "zero_fraction"), ("gradients", "norm"), ("updates", "ratio"))
#: The update-to-weight ratio a healthy layer has; the summary ranks ratios by their distance from it.
HEALTHY_RATIO = 1e-3
_PROFILES = (
    ("activation std", ("activations", "std"), True), ("zero fraction", ("activations", "zero_fraction"), False),
    ("gradient norm", ("gradients", "norm"), True), ("update ratio", ("updates", "ratio"), True),
)


@dataclass
class _Extremes:
    """One layer's figure: its latest value, and its lowest and highest with their steps (NaN left out)."""

    latest: float
    low: tuple[float, int]
    high: tuple[float, int]

    def add(self, value: float, step: int) -> None:
        self.latest = value
        if value < self.low[0]:
            self.low = (value, step)
        if value > self.high[0]:
            self.high = (value, step)


def _ratio_badness(value: float) -> float:
    return abs(math.log10(value / HEALTHY_RATIO)) if value > 0 else math.inf


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}")


class LayerHealth(FigureListener, Callback):
    """Draw each layer's health to TensorBoard as pictures, and sum it up in text at the end of ``fit``.

    It computes nothing on the device and brings nothing to the host: it is handed, on rank
    zero, the figures an :class:`~lightning_hooks.ActivationMonitor` and a
    :class:`~lightning_hooks.GradientMonitor` (in the same ``callbacks``) log anyway, and keeps
    a bounded record of them on the host. From it, at the first logged step, every
    ``image_every_n_steps`` (as Lightning logs: at step ``n`` once ``n + 1`` reaches a multiple,
    19, 39 … for 20, or the first logged step after) and at the end of training, at most
    ``max_images`` times per picture in all, it writes to each ``TensorBoardLogger``:

    - ``health/activation_histograms``: one panel per module (at most ``max_panels``) of its
      activation histograms over the logged steps, steps across, bins up, ``log1p(count)`` as
      colour (as fastai's colourful-dimension plot; needs the monitor's ``histogram=True``). At
      most ``max_columns`` steps per panel: past that every other one is dropped, and later
      steps are kept at the wider spacing.
    - ``health/depth_profile``: the latest activation ``std`` and ``zero_fraction``, gradient
      ``norm`` and update ``ratio`` (those that are logged) against layer index.

    Drawing both takes about half a second on rank zero (matplotlib), hence the bounds.

    At the end of training it writes ``health/summary`` (TensorBoard text) and prints it on
    rank zero: per figure the ``top_k`` worst layers, with the step each was worst at: dead
    units (highest zero fraction), vanishing and exploding gradients (lowest and highest norm),
    and update ratios farthest from 1e-3 (:meth:`summary` returns it). The record covers one
    ``fit`` and is not checkpointed. Needs matplotlib (``pip install 'lightning-hooks[health]'``).

    Args:
        image_every_n_steps: Draw the pictures every this many optimizer steps.
        max_images: The most pictures of each kind to write in a ``fit``, the final one included.
        max_panels: The most modules the heatmap shows (the first ones logged).
        max_columns: The most steps one heatmap panel keeps.
        top_k: How many layers the summary lists per figure.

    Raises:
        ValueError: If an argument is not a positive int.
        ModuleNotFoundError: If matplotlib is not installed.

    Example::

        from lightning import Trainer
        from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth

        trainer = Trainer(callbacks=[ActivationMonitor(), GradientMonitor(update_ratio=True),
                                     LayerHealth(image_every_n_steps=500)])
    """

    def __init__(self, image_every_n_steps: int = 500, max_images: int = 10, max_panels: int = 16,
                 max_columns: int = 100, top_k: int = 3) -> None:
        for name, value in (("image_every_n_steps", image_every_n_steps), ("max_images", max_images),
                            ("max_panels", max_panels), ("max_columns", max_columns), ("top_k", top_k)):
            _positive_int(name, value)
        if importlib.util.find_spec("matplotlib") is None:
            raise ModuleNotFoundError("LayerHealth draws with matplotlib: pip install 'lightning-hooks[health]'")
        self.image_every_n_steps, self.max_images, self.max_panels = image_every_n_steps, max_images, max_panels
        self.max_columns, self.top_k = max_columns, top_k
        self._reset()

    def _reset(self) -> None:
        self._figures: dict[tuple[str, str], dict[str, _Extremes]] = {}
        self._columns: dict[str, list[Column]] = {}
        self._seen: dict[str, int] = {}  # histograms received per module, and the spacing of those kept
        self._stride: dict[str, int] = {}
        self._edges: dict[str, list[float]] = {}  # per module: monitors may bin differently
        self._images, self._next_image = 0, 0
        self._last: Optional[int] = None  # the last logged step
        self._fresh = False  # whether figures came in since the last pictures

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Start a new record; warn when there is nothing to draw from, or nowhere to draw to."""
        if stage != "fit":
            return
        self._reset()
        if not any(isinstance(cb, (ActivationMonitor, GradientMonitor)) for cb in getattr(trainer, "callbacks", ())):
            rank_zero_warn("LayerHealth: no ActivationMonitor or GradientMonitor in `callbacks`: nothing to show")
        if not any(isinstance(lg, TensorBoardLogger) for lg in trainer.loggers):
            rank_zero_warn("LayerHealth: no TensorBoardLogger, so no pictures; the summary is still printed")

    def record_scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """Keep the watched figures: each layer's latest, lowest and highest value."""
        for tag, value in metrics.items():
            prefix, _, rest = tag.partition("/")
            name, _, stat = rest.rpartition("/")
            if name and (prefix, stat) in WATCHED and not math.isnan(value):
                layers = self._figures.setdefault((prefix, stat), {})
                if name in layers:
                    layers[name].add(value, step)
                else:
                    layers[name] = _Extremes(value, (value, step), (value, step))
        self._last, self._fresh = step, True

    def record_histograms(self, histograms: Sequence[Histogram], edges: Sequence[float], step: int) -> None:
        """Keep the activation histograms' counts, one column per logged step (bounded)."""
        shared = list(edges)
        for tag, _, counts in histograms:
            prefix, _, name = tag.partition("/")
            if prefix == "activations" and "/" not in name and self._add_column(name, step, counts):
                self._edges[name] = shared
        self._last, self._fresh = step, True

    def _add_column(self, name: str, step: int, counts: Sequence[float]) -> bool:
        """Keep one step's counts for ``name`` if there is room; return whether they were kept."""
        if name not in self._columns and len(self._columns) >= self.max_panels:
            return False
        seen, stride = self._seen.get(name, 0), self._stride.get(name, 1)
        self._seen[name] = seen + 1
        if seen % stride:
            return False
        columns = self._columns.setdefault(name, [])
        columns.append((step, np.asarray(counts, dtype=np.float64)))
        if len(columns) > self.max_columns:
            self._columns[name], self._stride[name] = columns[::2], stride * 2
        return True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Draw when due, once every monitor has logged the last logged step."""
        step = self._last
        # Due as Lightning logs: at step n once n + 1 reaches a multiple (19, 39 … for 20), and at the first.
        if self._fresh and step is not None and step + 1 >= self._next_image and self._images < self.max_images - 1:
            self._draw(trainer, step)
            self._next_image = ((step + 1) // self.image_every_n_steps + 1) * self.image_every_n_steps

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Draw the last pictures, and write and print the summary (rank zero)."""
        if not trainer.is_global_zero or self._last is None:
            return
        if self._fresh:  # else the last logged step is drawn already
            self._draw(trainer, self._last)
        text = self.summary()
        log_text(trainer, "health/summary", "\n".join("    " + line for line in text.splitlines()), self._last)
        rank_zero_info(text)

    def _draw(self, trainer: pl.Trainer, step: int) -> None:
        from lightning_hooks._health_plots import heatmap_figure, profile_figure, to_rgb

        images = []
        if self._columns:
            images.append(("health/activation_histograms", heatmap_figure(self._columns, self._edges)))
        profiles = self._profiles()
        if profiles:
            images.append(("health/depth_profile", profile_figure(profiles)))
        pixels = [(tag, to_rgb(fig)) for tag, fig in images]
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                for tag, rgb in pixels:
                    logger.experiment.add_image(tag, rgb, global_step=step, dataformats="HWC")
        self._images, self._fresh = self._images + 1, False

    def _profiles(self) -> list[Profile]:
        return [(title, list(layers), [e.latest for e in layers.values()], log)
                for title, key, log in _PROFILES if (layers := self._figures.get(key))]

    def summary(self) -> str:
        """The worst layers per figure so far, with the step each was worst at."""
        get = self._figures.get
        ratios = [(name, *min(e.low, e.high, key=lambda v: -_ratio_badness(v[0])))
                  for name, e in get(("updates", "ratio"), {}).items()]
        sections = [
            ("dead units: zero fraction of outputs, highest",
             sorted(((n, *e.high) for n, e in get(("activations", "zero_fraction"), {}).items()), key=lambda r: -r[1])),
            ("vanishing gradients: norm, lowest",
             sorted(((n, *e.low) for n, e in get(("gradients", "norm"), {}).items()), key=lambda r: r[1])),
            ("exploding gradients: norm, highest",
             sorted(((n, *e.high) for n, e in get(("gradients", "norm"), {}).items()), key=lambda r: -r[1])),
            (f"update ratio: farthest from {HEALTHY_RATIO:g}", sorted(ratios, key=lambda r: -_ratio_badness(r[1]))),
        ]
        lines = [f"Layer health (the worst {self.top_k} layers per figure, and the step each was worst at):"]
        for title, rows in sections:
            if rows:
                lines.append(f"  {title}")
                lines.extend(f"    {name:30} {value:10.4g}   at step {step}" for name, value, step in rows[:self.top_k])
        return "\n".join(lines)
