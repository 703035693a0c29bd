"""LayerHealth's pictures: pure functions from host figures to matplotlib Figures (headless, no pyplot).

Sized for TensorBoard's image cards: the Time Series dashboard fits an image into a card of
about 335-500 x 230 px and the Images tab draws it 350 px wide, so each picture is one panel of
:data:`SIZE` (480 x 320 px) with 10-11 px text, shown at about 70-100 % of its size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from lightning_hooks.output.figures import Column

#: Every picture, in inches at :data:`DPI`: 480 x 320 pixels.
SIZE = (4.8, 3.2)
DPI = 100
#: The colour scale of the histograms: the share of a step's values in a bin, from 1e-4 to all.
SHARE_RANGE = (1e-4, 1.0)
_WARN = "#d62728"  # matplotlib's red: a figure outside its healthy band

class Profile(NamedTuple):
    """One depth profile: its figure's name, the layers in forward order, each layer's kind and value."""

    title: str
    layers: Sequence[str]
    kinds: Sequence[str]
    values: Sequence[float]
    log: bool
    """Whether the y axis is logarithmic."""


def image_size() -> tuple[int, int]:
    """The pixel size (width, height) of every picture."""
    return round(SIZE[0] * DPI), round(SIZE[1] * DPI)


def heatmap_figure(name: str, columns: Sequence[Column], edges: Sequence[float], dead_above: float) -> Figure:
    """One module's outputs over the logged steps: a histogram heatmap over a strip of exact zeros.

    Steps across, values up, colour the share of the step's values in each bin (one log scale
    for every module, so colours compare); exact zeros, which share a bin with tiny values,
    are taken out and drawn below as their share of the step's values, red above ``dead_above``.
    """
    steps = [step for step, _, _ in columns]
    counts = np.stack([c for _, c, _ in columns], axis=1)
    zeros = np.array([z for _, _, z in columns])
    totals = counts.sum(0) + zeros
    fig = Figure(figsize=SIZE, dpi=DPI)
    # The strip of exact zeros only for a module that had some: a Linear's would be empty by construction.
    grid = fig.add_gridspec(2 if zeros.any() else 1, 2, height_ratios=(3, 1) if zeros.any() else None,
                            width_ratios=(30, 1), hspace=0.12, wspace=0.04, left=0.16, right=0.86, bottom=0.14,
                            top=0.89)
    ax, bar = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    share = counts / np.maximum(totals, 1)
    used = np.flatnonzero(counts.sum(1))
    lo, hi = (used[0], used[-1] + 1) if used.size else (0, counts.shape[0])
    shown = np.ma.masked_less_equal(share[lo:hi], 0)
    image = ax.imshow(shown, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                      norm=LogNorm(*SHARE_RANGE), extent=(-0.5, len(steps) - 0.5, lo, hi))
    ax.set_facecolor("#f2f2f2")
    ticks = _value_ticks(edges, lo, hi)
    ax.set_yticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=9)
    ax.set_ylabel("output value", fontsize=10)
    zero_share = np.where(totals > 0, zeros / np.maximum(totals, 1), np.nan)
    bottom = ax
    if zeros.any():
        bottom = fig.add_subplot(grid[1, 0])
        ax.set_xticks([])
        dead = bool(np.nanmax(zero_share) > dead_above)
        bottom.fill_between(range(len(steps)), zero_share, step="mid", color=_WARN if dead else "#7f7f7f", alpha=0.8)
        bottom.axhline(dead_above, color=_WARN, linestyle="--", linewidth=0.8)
        bottom.set_xlim(-0.5, len(steps) - 0.5)
        bottom.set_ylim(0, 1)
        bottom.set_yticks([0, 1], ["0", "all"], fontsize=9)
        bottom.set_ylabel("exact 0", fontsize=10)
    xticks = np.unique(np.linspace(0, len(steps) - 1, num=min(5, len(steps))).round().astype(int))
    bottom.set_xticks(xticks, [str(steps[t]) for t in xticks], fontsize=9)
    bottom.set_xlabel("step", fontsize=10)
    colorbar = fig.colorbar(image, cax=bar)
    colorbar.set_label("share of the step's values", fontsize=9)
    colorbar.ax.tick_params(labelsize=8)
    latest = zero_share[-1]
    note = f": {latest:.0%} exact zeros" if math.isfinite(latest) and latest > 0 else ""
    note += f" (dead units above {dead_above:.0%})" if latest > dead_above else ""
    fig.suptitle(f"{name} outputs{note}", fontsize=11, color=_WARN if latest > dead_above else "black")
    return fig


def _value_ticks(edges: Sequence[float], lo: int, hi: int) -> list[tuple[float, str]]:
    """About five y ticks for rows ``lo:hi`` (a row per bin), at bin edges, labelled with their values."""
    rows = np.unique(np.linspace(lo, hi, num=min(5, hi - lo + 1)).round().astype(int))
    return [(float(r), _short(edges[r])) for r in rows if 0 <= r < len(edges)]


def _short(value: float) -> str:
    """A bin edge as a tick label: ``0``, ``0.2``, ``30``, ``-5e-4``, ``max`` (float32's)."""
    if value == 0 or abs(value) > 1e30:
        return "0" if value == 0 else ("-max" if value < 0 else "max")
    text = f"{value:.2g}" if 1e-2 <= abs(value) < 1e4 else f"{value:.0e}"
    return text.replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


def profile_figure(profile: Profile, band: tuple[float, float] | None = None, limit: float | None = None) -> Figure:
    """One figure against depth: a line per kind of layer (Linear, ReLU...), layers in forward order.

    Lines per kind keep a profile from zig-zagging where kinds alternate; ``band`` shades the
    healthy range, ``limit`` draws the threshold above which a layer is unhealthy.
    """
    title, names, kinds, values, log = profile
    fig = Figure(figsize=SIZE, dpi=DPI)
    ax = fig.add_subplot(1, 1, 1)
    for kind in dict.fromkeys(kinds):
        at = [i for i, k in enumerate(kinds) if k == kind]
        ax.plot(at, [values[i] for i in at], marker="o", markersize=4, label=kind)
    if band is not None:
        ax.axhspan(*band, color="#2ca02c", alpha=0.12, label="healthy")
    if limit is not None:
        ax.axhline(limit, color=_WARN, linestyle="--", linewidth=1, label="unhealthy above")
    positive = [v for v in values if math.isfinite(v) and v > 0]
    if log and positive:
        ax.set_yscale("log")
        # Ticks written short ("20", "5e-4"), at 1, 2 and 5 where the range spans under two
        # decades: matplotlib's own labels minor ticks as "2 x 10^0" there, and they overlap.
        few = math.log10(max(positive) / min(positive)) < 2
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if few else (1.0,), numticks=8))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: _short(value)))
        ax.yaxis.set_minor_formatter(NullFormatter())
    if limit is not None and limit <= 1:  # a share: all of 0..1, so 0.5 and 0.9 look as far apart as they are
        ax.set_ylim(0, 1.02)
    step = max(1, math.ceil(len(names) / 12))
    ax.set_xticks(range(0, len(names), step), list(names)[::step], rotation=30, ha="right", fontsize=9)
    ax.tick_params(axis="y", labelsize=9)
    ax.set_xlabel("layer, in forward order", fontsize=10)
    ax.set_ylabel(title, fontsize=10)
    ax.set_title(f"{title} by layer (latest logged step)", fontsize=11)
    ax.legend(fontsize=8, loc="best")
    fig.subplots_adjust(left=0.15, right=0.97, bottom=0.27, top=0.9)
    return fig


def to_rgb(fig: Figure) -> np.ndarray:
    """Render ``fig`` headless (Agg) to an ``(height, width, 3)`` uint8 array."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
