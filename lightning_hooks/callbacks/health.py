"""LayerHealth: each layer's health at a glance, drawn from the figures the monitors already log."""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hooks.callbacks._base import claim, release
from lightning_hooks.callbacks._judged_rows import judged_apart, lookups
from lightning_hooks.callbacks._loss_pull import PredictionPull
from lightning_hooks.callbacks.activations import ActivationMonitor
from lightning_hooks.callbacks.gradients import GradientMonitor
from lightning_hooks.callbacks.stability import TransformerStability
from lightning_hooks.core._compat import CALLBACK_BASES, TENSORBOARD_LOGGERS, callbacks_of
from lightning_hooks.core._validation import check_int
from lightning_hooks.output._diagnosis import diagnose, param_groups
from lightning_hooks.output._findings import owner_of
from lightning_hooks.output._health_verdicts import (
    JUDGED,
    STABILITY_BANDS,
    Bands,
    Verdicts,
    judged_figure,
)
from lightning_hooks.output.figures import Diagnoses, FigureListener, HistogramColumns
from lightning_hooks.output.sinks import log_text

if TYPE_CHECKING:
    from lightning_hooks.output.figures import HistogramBlock, ScalarBlock

_log = logging.getLogger(__name__)

#: The figures drawn against depth, as (tag prefix, stat), with each picture's name and y axis.
PROFILES = {
    ("activations", "std"): ("activation_std", "activation std", True),
    ("activations", "zero_fraction"): ("zero_fraction", "zero fraction", False),
    ("gradients", "norm"): ("gradient_norm", "gradient norm", True),
    ("updates", "ratio"): ("update_ratio", "update ratio", True),
    ("activation_grads", "std"): ("output_gradient_std", "output gradient std", True),
}


class LayerHealth(FigureListener, Diagnoses, *CALLBACK_BASES):  # type: ignore[misc]  # the Callback of each Lightning package
    """Judge each layer's health against documented bands, draw it to TensorBoard, and give a verdict at the end.

    It is handed, on rank zero, the figures an :class:`~lightning_hooks.ActivationMonitor` and a
    :class:`~lightning_hooks.GradientMonitor` (in the same ``callbacks``) log anyway, and keeps
    a bounded record of them on the host. It measures one figure itself, on the monitor's logged
    steps: the prediction layer's (the last module in forward order's) ``sum(y * dL/dy)``,
    logged as ``activation_grads/<module>/pull``, from its own parameters' gradients (two small
    reductions, brought to the host in the monitor's own transfer; not measured under sharded strategies, or where
    the module is not linear in its parameters or shares one): a prediction layer growing while
    the loss asks for it (below 0) is learning, not blowing up. From it, at the first logged step, every
    ``image_every_n_steps`` (as Lightning logs: at step ``n`` once ``n + 1`` reaches a multiple,
    19, 39 … for 20, or the first logged step after) and at the end of training, at most
    ``max_images`` times per picture in all, it writes to each ``TensorBoardLogger`` pictures of
    480 x 320 pixels, readable at the size TensorBoard's image cards show them:

    - ``health/activation_histograms/<module>`` (at most ``max_panels`` modules): the module's
      outputs over the logged steps, steps across, values up, colour the share of the step's
      values in each bin (one log scale with a colour bar, so modules compare), and below it
      the share of exact zeros, red above ``max_zero_fraction`` (needs the monitor's
      ``histogram=True``). At most ``max_columns`` steps: past that every other one is dropped,
      and later steps are kept at the wider spacing.
    - ``health/depth_profile/<figure>``: the latest activation ``std`` and ``zero_fraction``,
      gradient ``norm`` and update ``ratio`` (those that are logged) against the layer's place
      in forward order, one line per kind of module (Linear, ReLU...), with the healthy band.

    A layer is named when it goes out of its own usual range while the layers before it in
    forward order stay in theirs (docs/verdicts.md; ``lightning_hooks.output._judge``): its
    outputs' std (``level_factor``), its gradient norm (``norm_factor``) or its update ratio
    (``ratio_factor``, not judged for a 1-D parameter row, a bias or a norm's scale) against its
    own last ``window`` logged values, the last two net of the step's common move of every layer;
    more than ``max_zero_fraction`` of its outputs exactly 0 from its first logged point or for 3
    logged points in a row as its live outputs fell to half the most they were over its last 24
    steps (then while it stays above), or 99% at once (dead units); the gradient reaching its output
    (``ActivationMonitor(gradients=True)``; ``output_grad_factor``), the last such
    module in forward order named, the modules before it its victims; a NaN or Inf in its
    outputs or gradients; and, from a :class:`~lightning_hooks.TransformerStability` in the same
    ``callbacks`` (whose bands it then takes), attention logits or output logits too large,
    attention entropy collapsed, massive activations. The layers it hurt are counted, not named;
    every layer moving at once is reported as the batch (``every layer at once: look at the
    batch``). At the end of training it
    writes ``health/summary`` (TensorBoard text) and prints once, on rank zero, the verdict
    (:meth:`summary` returns it): ``healthy``, or per problem the layers unhealthy now, the
    earliest first, with their worst value and the step since which they are, and those that
    were and recovered; then the diagnosis of each layer unhealthy now: how far from its band,
    where it started, and what usually helps, with the evidence (see
    ``lightning_hooks.output._diagnosis``). The record covers one ``fit`` and is not checkpointed. The pictures
    need matplotlib (the ``health`` extra); without it the verdict is still
    written and printed.

    Every argument is keyword-only.

    Args:
        image_every_n_steps: Draw the pictures every this many optimizer steps.
        max_images: The most pictures of each kind to write in a ``fit``, the final one included.
        max_panels: The most modules whose histograms are drawn (the first ones logged).
        max_columns: The most steps one histogram picture keeps.
        top_k: The most layers the summary lists per problem (the rest are counted).
        max_zero_fraction: Dead units above this share of exact zeros in a layer's outputs.
        level_factor: The least change of a layer's output std, either way, that names it.
        norm_factor: The least change of a gradient norm (net of the other layers') that names it.
        ratio_factor: The least change of an update ratio (net of the other layers') that names it.
        window: How many of a row's last logged values its usual range is taken over.
        output_grad_factor: The least change of the gradient reaching a module's output (its
            ``std``), up (its square down), that names it.

    Raises:
        ValueError: If an image or ``top_k`` argument is not a positive int, or a band is not
            as documented on :class:`~lightning_hooks.output._health_bands.Bands`.

    Example::

        from lightning import Trainer
        from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth

        trainer = Trainer(callbacks=[ActivationMonitor(), GradientMonitor(update_ratio=True),
                                     LayerHealth(image_every_n_steps=500, norm_factor=3.0)])
    """

    def __init__(self, *, image_every_n_steps: int = 500, max_images: int = 10, max_panels: int = 16,
                 max_columns: int = 100, top_k: int = 5, max_zero_fraction: float = 0.8,
                 level_factor: float = 1.25, norm_factor: float = 4.0, ratio_factor: float = 4.0,
                 window: int = 32, output_grad_factor: float = 4.0) -> None:
        for name, value in (("image_every_n_steps", image_every_n_steps), ("max_images", max_images),
                            ("max_panels", max_panels), ("max_columns", max_columns), ("top_k", top_k)):
            check_int(name, value)
        self._bands = Bands(max_zero_fraction, level_factor, norm_factor, ratio_factor, window=window,
                            min_points=min(24, window), output_grad_factor=output_grad_factor)
        self._drawable = _has_matplotlib()
        self.image_every_n_steps, self.max_images, self.max_panels = image_every_n_steps, max_images, max_panels
        self.max_columns, self.top_k = max_columns, top_k
        self.max_zero_fraction, self.level_factor = max_zero_fraction, level_factor
        self.norm_factor, self.ratio_factor, self.window = norm_factor, ratio_factor, window
        self.output_grad_factor = output_grad_factor
        self._kinds: dict[str, str] = {}
        self._vectors: set[str] = set()  # 1-D parameters but norms' scales: ratios not judged
        self._scales: set[str] = set()  # norms' scales: ratios judged apart
        self._groups: dict[str, str] = {}  # each module's optimizer param group, for the diagnosis
        self._reset()

    def _reset(self) -> None:
        self._latest: dict[tuple[str, str], dict[str, float]] = {}  # each profile's latest value per layer
        self._verdicts = Verdicts(self._bands)
        self._histograms = HistogramColumns("activations", self.max_panels, self.max_columns)
        self._images, self._next_image = 0, 0
        self._last: Optional[int] = None  # the last logged step
        self._pull = PredictionPull()
        self._fresh = False  # whether figures came in since the last pictures

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Start a new record; warn when there is nothing to draw from, or nowhere to draw to."""
        if stage != "fit":
            return
        claim(self, trainer)
        self._reset()
        self._kinds = {name: type(module).__name__ for name, module in pl_module.named_modules()}
        self._vectors, self._scales = judged_apart(pl_module)
        self._groups = {}
        monitors = callbacks_of(trainer, ActivationMonitor)
        self._pull.start(trainer, monitors[0] if monitors else None)
        for stability in callbacks_of(trainer, TransformerStability)[:1]:  # judge its figures by its bands
            self._bands = replace(self._bands, **{name: getattr(stability.bands, name) for name in STABILITY_BANDS})
            self._verdicts = Verdicts(self._bands)
        if not any(callbacks_of(trainer, kind) for kind in (ActivationMonitor, GradientMonitor, TransformerStability)):
            rank_zero_warn("LayerHealth: no ActivationMonitor or GradientMonitor in `callbacks`: nothing to show")
        if not any(isinstance(lg, TENSORBOARD_LOGGERS) for lg in trainer.loggers):
            rank_zero_warn("LayerHealth: no TensorBoardLogger, so no pictures; the summary is still printed")
        elif not self._drawable:
            rank_zero_warn("LayerHealth: matplotlib is not installed, so no pictures; the summary is still"
                           " printed. To draw them: pip install matplotlib")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Free the instance for another Trainer."""
        self._pull.stop()
        release(self, trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Tell the judge the model's embeddings, read as ActivationMonitor reads them (after ``configure_model``)."""
        self._verdicts.judge.lookups = lookups(pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Free the instance for another Trainer when ``fit`` raises."""
        self._pull.stop()
        release(self, trainer)

    def record_figures(self, figures: Sequence[ScalarBlock], metrics: Mapping[str, float], step: int) -> None:
        """Judge the watched figures, and keep each layer's latest value for the depth profiles.

        Read from the typed blocks (kind, stat, row names), never from the tags.
        """
        judged: dict[str, dict[str, float]] = {}
        for block in figures:
            key = (block.kind, block.stat)
            if key in PROFILES:
                latest = self._latest.setdefault(key, {})
                latest.update((name, value) for name, value in zip(block.rows, block.values) if not math.isnan(value))
            figure = JUDGED.get(key)
            if figure is None:
                continue
            judged.setdefault(figure, {})
            for name, value in zip(block.rows, block.values):
                as_ = judged_figure(figure, name, value, self._vectors, self._scales)  # a 1-D row: apart, or none
                if as_ is not None:  # nonfinite: the worst of the non-finite share and counts
                    kept = judged.setdefault(as_, {})
                    kept[name] = max(kept.get(name, 0.0), value) if as_ == "nonfinite" else value
        for figure, values in judged.items():
            self._verdicts.add(figure, step, values)
        self._last, self._fresh = step, True

    def record_forward_order(self, order: Sequence[str]) -> None:
        """Judge in the order the modules ran (the Layers tab's), not the order they were registered in."""
        depth = self._verdicts.judge.depth
        ranked = [*order, *(name for name in depth if name not in set(order))]
        depth.clear()
        depth.update((name, i) for i, name in enumerate(ranked))
        self._pull.row = order[-1] if order else self._pull.row

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """On a logged step, take the prediction layer's pull, ``sum(y * dL/dy)`` (``_loss_pull.py``)."""
        self._pull.take(trainer, pl_module)

    def record_histograms(self, histograms: HistogramBlock, edges: Sequence[float], step: int) -> None:
        """Keep the activation histograms' counts, exact zeros apart, one column per logged step (bounded)."""
        self._histograms.add(histograms, edges, step)
        self._last, self._fresh = step, True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Draw when due, once every monitor has logged the last logged step."""
        step = self._last
        # Due as Lightning logs: at step n once n + 1 reaches a multiple (19, 39 … for 20), and at the first.
        due = step is not None and step + 1 >= self._next_image and self._images < self.max_images - 1
        if self._drawable and self._fresh and due:
            self._draw(trainer, step)
            self._next_image = ((step + 1) // self.image_every_n_steps + 1) * self.image_every_n_steps

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Note each module's optimizer parameter group (the optimizers exist now), for a diagnosis mid-fit."""
        self._groups = param_groups(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Draw the last pictures, and write and print the summary (rank zero, once)."""
        if not trainer.is_global_zero or self._last is None:
            return
        if self._drawable and self._fresh:  # else the last logged step is drawn already
            self._draw(trainer, self._last)
        self._groups = param_groups(trainer, pl_module)
        text = self.summary()
        log_text(trainer, "health/summary", "\n".join("    " + line for line in text.splitlines()), self._last)
        _log.info(text)

    def _draw(self, trainer: pl.Trainer, step: int) -> None:
        """Draw the pictures of ``step`` to TensorBoard; a drawing that fails warns and ends this fit's pictures.

        Pictures are side work: whatever matplotlib raises, the run, the verdicts and the summary go on.
        """
        if not any(isinstance(logger, TENSORBOARD_LOGGERS) for logger in trainer.loggers):
            return  # nowhere to draw to (setup warned)
        import matplotlib

        try:
            with matplotlib.rc_context({"text.parse_math": False}):  # names are text, not TeX: "$" is a legal name
                pixels = self._pictures()
        except Exception as err:
            rank_zero_warn(f"LayerHealth: drawing the pictures of step {step} failed ({type(err).__name__}: {err});"
                           " no more pictures this fit. The verdicts and the summary go on.")
            self._images, self._fresh = self.max_images, False
            return
        for logger in trainer.loggers:
            if isinstance(logger, TENSORBOARD_LOGGERS):
                for tag, rgb in pixels:
                    logger.experiment.add_image(tag, rgb, global_step=step, dataformats="HWC")
        self._images, self._fresh = self._images + 1, False

    def _pictures(self) -> list[tuple[str, np.ndarray]]:
        from lightning_hooks.output._health_plots import Profile, heatmap_figure, profile_figure, to_rgb

        kept = self._histograms
        figures = [(f"health/activation_histograms/{name}",
                    heatmap_figure(name, columns, kept.edges[name], self._bands.max_zero_fraction))
                   for name, columns in kept.columns.items()]
        for key, (tag, title, log) in PROFILES.items():
            layers = self._latest.get(key)
            if layers:
                kinds = [self._kind(name) for name in layers]
                band = None  # no fixed band: each layer against its own range (docs/verdicts.md)
                limit = self._bands.max_zero_fraction if tag == "zero_fraction" else None
                profile = Profile(title, list(layers), kinds, list(layers.values()), log)
                figures.append((f"health/depth_profile/{tag}", profile_figure(profile, band, limit)))
        return [(tag, to_rgb(fig)) for tag, fig in figures]

    def _kind(self, name: str) -> str:
        """The class name of the module a row belongs to (a parameter's: its owner's)."""
        return self._kinds.get(name) or self._kinds.get(owner_of(name), "other")

    @property
    def verdicts(self) -> Verdicts:
        """The record of the judged figures so far: each layer's episodes outside a band."""
        return self._verdicts

    def summary(self) -> str:
        """The verdict so far: ``healthy``, or the layers outside a band, per problem, since which step."""
        return diagnose(self._verdicts, self.top_k, self._groups)

    def diagnosis(self) -> str:
        """The diagnosis so far, as :meth:`summary` (what an :class:`~lightning_hooks.AnomalyReport` carries)."""
        return self.summary()


def _has_matplotlib() -> bool:
    """Whether matplotlib can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # blocked: None in sys.modules
        return False
