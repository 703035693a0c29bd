"""The judge's absolute rules: bounds the physics gives, no history needed (host-side, torch-free).

The half of :mod:`lightning_hooks.output._judge` that needs no row's range: a NaN or Inf in a
module's outputs, more than ``max_zero_fraction`` exact zeros (dead units), and
TransformerStability's attention-logit, entropy, output-logit and massive-activation bounds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping

from lightning_hooks.output._health_bands import Bands

#: TransformerStability's figures with an upper bound: each one's field of :class:`Bands` and its problem.
UPPER_BOUNDS = {"attention_max_logit": ("max_attention_logit", "attention_logits"),
                "logit_abs_max": ("max_output_logit", "output_logits"),
                "massive_ratio": ("max_massive_ratio", "massive")}


def absolute_problems(figure: str, values: Mapping[str, float], bands: Bands,
                      first_entropy: MutableMapping[str, float]) -> list[tuple[str, str, float]]:
    """The rows of an absolute ``figure`` past their bound, as ``(row, problem, value)``.

    Args:
        figure: ``nonfinite``, ``zero_fraction`` or a TransformerStability figure.
        values: Each row's value at the step.
        bands: The bounds.
        first_entropy: Each row's first finite positive attention entropy (updated here): entropy
            collapse is judged against it.
    """
    if figure == "nonfinite":
        return [(row, "nonfinite", v) for row, v in values.items() if v != 0]
    if figure == "zero_fraction":
        return [(row, "dead", v) for row, v in values.items() if v > bands.max_zero_fraction]
    if figure == "attention_entropy":
        for row, v in values.items():
            if math.isfinite(v) and v > 0:
                first_entropy.setdefault(row, v)
        return [(row, "entropy_collapse", v) for row, v in values.items()
                if row in first_entropy and v < bands.min_entropy_fraction * first_entropy[row]]
    field, problem = UPPER_BOUNDS[figure]
    limit = getattr(bands, field)
    return [(row, problem, v) for row, v in values.items() if v > limit]
