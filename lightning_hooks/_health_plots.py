"""LayerHealth's pictures: pure functions from host figures to matplotlib Figures (headless, no pyplot)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: One heatmap panel, in inches; images are drawn at :data:`DPI`, so a panel is 320 x 240 pixels.
PANEL = (3.2, 2.4)
#: One depth-profile panel, in inches (400 x 300 pixels).
PROFILE = (4.0, 3.0)
DPI = 100
#: Heatmap panels per row.
COLUMNS = 4

Column = tuple[int, np.ndarray]
"""One logged step of a module's histogram: the step and the count per bin."""

Profile = tuple[str, Sequence[str], Sequence[float], bool]
"""One depth-profile panel: its title, the layer names, a value per layer, and whether the y axis is log."""


def heatmap_size(panels: int) -> tuple[int, int]:
    """The pixel size (width, height) of a heatmap image of ``panels`` panels."""
    cols = min(COLUMNS, panels)
    return round(PANEL[0] * DPI) * cols, round(PANEL[1] * DPI) * math.ceil(panels / cols)


def heatmap_figure(series: Mapping[str, list[Column]], edges: Mapping[str, Sequence[float]]) -> Figure:
    """Histograms over steps, one panel per module: steps across, bins up, ``log1p(count)`` as colour.

    Each panel shows the bins its module ever filled (as fastai's "colorful dimension" plot),
    labelled with their lower edges (``edges`` per module).
    """
    cols = min(COLUMNS, len(series))
    rows = math.ceil(len(series) / cols)
    fig = Figure(figsize=(PANEL[0] * cols, PANEL[1] * rows), dpi=DPI)
    for index, (name, columns) in enumerate(series.items()):
        ax = fig.add_subplot(rows, cols, index + 1)
        counts = np.stack([c for _, c in columns], axis=1)
        used = np.flatnonzero(counts.sum(1))
        lo, hi = (used[0], used[-1] + 1) if used.size else (0, counts.shape[0])
        ax.imshow(np.log1p(counts[lo:hi]), aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
        yticks = np.linspace(0, hi - lo - 1, num=min(4, hi - lo)).round().astype(int)
        ax.set_yticks(yticks, [f"{edges[name][lo + t]:.0e}" for t in yticks], fontsize=6)
        xticks = np.linspace(0, len(columns) - 1, num=min(4, len(columns))).round().astype(int)
        ax.set_xticks(xticks, [str(columns[t][0]) for t in xticks], fontsize=6)
        ax.set_title(name, fontsize=8)
    fig.subplots_adjust(left=0.12, right=0.98, bottom=0.1, top=0.9, wspace=0.4, hspace=0.5)
    return fig


def profile_size(panels: int) -> tuple[int, int]:
    """The pixel size (width, height) of a depth-profile image of ``panels`` panels."""
    return round(PROFILE[0] * DPI) * panels, round(PROFILE[1] * DPI)


def profile_figure(profiles: Sequence[Profile]) -> Figure:
    """One panel per figure (activation std, zero fraction, gradient norm...) against layer index."""
    fig = Figure(figsize=(PROFILE[0] * len(profiles), PROFILE[1]), dpi=DPI)
    for index, (title, names, values, log) in enumerate(profiles):
        ax = fig.add_subplot(1, len(profiles), index + 1)
        ax.plot(range(len(values)), values, marker="o", markersize=3)
        if log and any(v > 0 for v in values if math.isfinite(v)):
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer index", fontsize=8)
        if len(names) <= 12:
            ax.set_xticks(range(len(names)), names, rotation=90, fontsize=6)
        ax.tick_params(labelsize=6)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.32, top=0.9, wspace=0.35)
    return fig


def to_rgb(fig: Figure) -> np.ndarray:
    """Render ``fig`` headless (Agg) to an ``(height, width, 3)`` uint8 array."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
