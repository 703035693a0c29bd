"""Each judged figure's colour scale, fixed and anchored to its healthy band, so that noise never looks like an event.

A scale is a list of stops ``[value, position]`` (position 0-1 on the palette, linear between
stops, clamped beyond the ends; a third item, if any, is the stop's label on the colour bar):
the healthy band takes the middle colours and a value out of the band goes to the palette's
ends, saturating beyond them. A figure with no fixed band (LayerHealth judges gradient norms and
update ratios against each layer's own history and its peers, and does not judge the rest) gets None:
the browser colours it over its own range, with a least span, and states that range.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning_hooks.output._health_verdicts import Bands
from lightning_hooks.tensorboard_plugin.run_data import Figure
from lightning_hooks.tensorboard_plugin.verdicts import judged_as

# Where a band's ends sit on the palette: healthy in the middle colours, out of band at the ends.
LOW_END, HIGH_END = 0.2, 0.75


def colour_scale(figure: Figure, bands: Bands) -> Optional[dict[str, Any]]:
    """The fixed colour scale of a judged figure: ``{"stops", "log", "band"}``, or None (no fixed band).

    ``band`` is the healthy band as the legend states it (``[low, high]``, either may be None).
    """
    kind = judged_as(figure)
    if kind == "zero_fraction":
        limit = bands.max_zero_fraction
        return _scale([[0.0, LOW_END], [limit, HIGH_END], [1.0, 1.0]], [None, limit])
    if kind == "nonfinite":  # any non-finite value is out of band: from 0 straight to the top colours
        return _scale([[0.0, LOW_END, "0"], [1e-9, 0.9, "> 0"], [1.0, 1.0, "1"]], [None, 0.0])
    if kind == "attention_max_logit":
        return _upper(bands.max_attention_logit)
    if kind == "logit_abs_max":
        return _upper(bands.max_output_logit)
    if kind == "massive_ratio":
        top = math.log10(bands.max_massive_ratio)
        return _scale([[0.0, LOW_END], [top, HIGH_END], [top + 2, 1.0]], [None, bands.max_massive_ratio], log=True)
    if kind == "attention_entropy":  # judged as a fraction of each layer's first value: anchored to the largest
        first = [next((v for v in row if v is not None and math.isfinite(v) and v > 0), None) for row in figure.values]
        level = max((v for v in first if v is not None), default=None)
        if level is None:
            return None
        low = bands.min_entropy_fraction * level
        return _scale([[0.0, 0.0], [low, LOW_END], [level, HIGH_END], [1.5 * level, 1.0]], [low, None])
    return None


def _upper(limit: float) -> dict[str, Any]:
    """A band with only a top: 0 to ``limit`` healthy, twice it saturating."""
    return _scale([[0.0, LOW_END], [limit, HIGH_END], [2 * limit, 1.0]], [None, limit])


def _scale(stops: list[list[Any]], band: list[Optional[float]], log: bool = False) -> dict[str, Any]:
    return {"stops": stops, "band": band, "log": log}
