"""The healthy bands LayerHealth, TransformerStability and the Layers tab judge by, and where each comes from.

Host-side and torch-free (the TensorBoard plugin imports it).

- dead units: a ReLU-like layer whose inputs are centred outputs about half zeros; above
  ``max_zero_fraction`` (0.8) of its outputs exactly 0, most of its units never fire.
- exploding gradients: a row's gradient norm above ``spike_factor`` (10) times the median of
  its own last ``window`` logged norms (at least 3): a jump against the layer's own history,
  not a large norm, which a wide layer has by its size.
- vanishing gradients: a row's norm below the largest row norm at that step divided by
  ``spread_factor`` (1e5): five decades below its neighbours, far beyond the spread of a
  healthy network's weights and biases.
- update ratio: ``||Δw|| / ||w||`` outside ``update_ratio_band`` (1e-4 to 1e-2, two decades
  around the usual 1e-3): the layer learns too fast or too slowly. An undefined ratio (a
  parameter that was all zeros) is not judged.
- non-finite: any NaN or Inf in a layer's outputs, or in its gradient norm.
- attention logit growth (TransformerStability): the largest ``q·k·scale`` above
  ``max_attention_logit`` (30): at a logit gap of 30 the top key takes all but ``e^-30`` of its
  weight, so the softmax has saturated and its gradient vanishes; at initialisation these logits
  are O(1), and Dehghani et al. 2023 (ViT-22B) and Wortsman et al. 2023 saw them grow without
  bound before divergence.
- attention entropy collapse: a layer's mean attention entropy below ``min_entropy_fraction``
  (0.1) of its first logged value: its heads went from spreading their attention to looking
  at one token each (Zhai et al. 2023, who tie it to training instability).
- output logit growth: the largest ``|logit|`` above ``max_output_logit`` (100): in bfloat16 a
  logit past 128 is rounded to a whole nat, and z-loss (PaLM) exists to keep ``log Z`` near 0.
- massive activations: a block's ``max|x| / median|x|`` above ``max_massive_ratio`` (1e4):
  Sun et al. 2024 report a few features ~1e4 times the median in large language models,
  where they act as attention sinks; far from harmless in low precision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_hooks.core._validation import MAX_WINDOW, check_int, check_number

#: The problems, in the order the summary lists them, with how each is written.
PROBLEMS = {
    "nonfinite": "non-finite outputs",
    "nonfinite_grad": "non-finite gradients",
    "dead": "dead units: zero fraction of outputs above {max_zero_fraction:g}",
    "exploding": "exploding gradients: norm above {spike_factor:g}x its own median",
    "vanishing": "vanishing gradients: norm below the largest layer's / {spread_factor:g}",
    "too_fast": "learning too fast: update ratio above {high:g}",
    "too_slow": "learning too slowly: update ratio below {low:g}",
    "attention_logits": "attention logit growth: max attention logit above {max_attention_logit:g}",
    "entropy_collapse": "attention entropy collapse: entropy below {min_entropy_fraction:g}x its first logged value",
    "output_logits": "output logit growth: max |logit| above {max_output_logit:g}",
    "massive": "massive activations: max|x| / median|x| above {max_massive_ratio:g}",
}


@dataclass(frozen=True)
class Bands:
    """The healthy bands LayerHealth judges by (see the module docstring for where each comes from).

    Raises:
        ValueError: If ``max_zero_fraction`` is not in (0, 1], a factor is not a number above 1,
            ``window`` is not an int of at least 3, or ``update_ratio_band`` is not ``(low, high)``
            with ``0 < low < high``.
    """

    max_zero_fraction: float = 0.8
    spike_factor: float = 10.0
    spread_factor: float = 1e5
    update_ratio_band: tuple[float, float] = (1e-4, 1e-2)
    window: int = 20
    max_attention_logit: float = 30.0
    min_entropy_fraction: float = 0.1
    max_output_logit: float = 100.0
    max_massive_ratio: float = 1e4

    def __post_init__(self) -> None:
        check_number("max_zero_fraction", self.max_zero_fraction, 0.0, high=1.0)
        check_number("spike_factor", self.spike_factor, 1.0)
        check_number("spread_factor", self.spread_factor, 1.0)
        band = self.update_ratio_band
        expected, fix = "(low, high) with 0 < low < high", "e.g. update_ratio_band=(1e-4, 1e-2)"
        if not isinstance(band, Sequence) or isinstance(band, str) or len(band) != 2:
            raise TypeError(f"`update_ratio_band` must be {expected}, got {band!r} ({type(band).__name__}): {fix}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in band):
            raise TypeError(f"`update_ratio_band` must be {expected}, two numbers, got {band!r}: {fix}")
        if not all(math.isfinite(v) for v in band) or not 0 < band[0] < band[1]:
            raise ValueError(f"`update_ratio_band` must be {expected}, got {band!r}: {fix}")
        check_int("window", self.window, low=3, high=MAX_WINDOW)
        for name in ("max_attention_logit", "max_output_logit", "max_massive_ratio"):
            check_number(name, getattr(self, name), 0.0)
        check_number("min_entropy_fraction", self.min_entropy_fraction, 0.0, high=1.0)

    def titles(self) -> dict[str, str]:
        """Each problem's heading, with its threshold."""
        low, high = self.update_ratio_band
        return {key: text.format(low=low, high=high, **vars(self)) for key, text in PROBLEMS.items()}
