"""The healthy bands LayerHealth, TransformerStability and the Layers tab judge by, and where each comes from.

Host-side and torch-free (the TensorBoard plugin imports it).

- dead units: a ReLU-like layer whose inputs are centred outputs about half zeros; above
  ``max_zero_fraction`` (0.8) of its outputs exactly 0 from its first logged point, or for 3 logged
  points in a row (a small batch's sparsity crosses it for one) with its live outputs fallen to half the
  most they were over its last 24 steps (units dying, not a sparsity creeping up as it learns), or 99% at once,
  most of its units never fire.
- a layer's outputs (activation std), gradient norm and update ratio are judged against the
  layer's own history (the median of its last ``window`` logged values, on a log scale) and, for
  gradient norms and update ratios, against the step's common move of all layers (the schedule,
  the loss falling, the batch): a two-sided CUSUM in units of the layer's own noise
  (``cusum``) and a change of at least ``level_factor`` (outputs, 1.25), ``norm_factor``
  (gradients, 4) or ``ratio_factor`` (update ratios, 4) up, its square down (a layer settling
  is common, a layer dying is far below), once the row has ``min_points`` (24) logged values.
  The gradient reaching a module's output (ActivationMonitor's ``gradients=True``: its ``std``)
  is judged as the outputs are, against its own history only, by ``output_grad_factor`` (4).
  No fixed band: Adam's update ratio is about ``lr / rms(w)``, so a band judges the recipe, not
  the layer (docs/verdicts.md).
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

from dataclasses import dataclass

from lightning_hooks.core._validation import MAX_WINDOW, check_int, check_number

#: The problems, in the order the summary lists them, with how each is written.
PROBLEMS = {
    "nonfinite": "non-finite outputs",
    "nonfinite_grad": "non-finite gradients",
    "dead": "dead units: zero fraction of outputs above {max_zero_fraction:g}",
    "data": "every layer at once: look at the batch",
    "blowup": "outputs blowing up: activation std above its usual range",
    "collapse": "outputs vanishing: activation std below its usual range",
    "output_grad_exploding": "exploding output gradient: the gradient reaching the layer's output above its usual"
                             " range",
    "output_grad_vanishing": "vanishing output gradient: the gradient reaching the layer's output below its usual"
                             " range",
    "exploding": "exploding gradients: norm above its usual range, against the other layers'",
    "vanishing": "vanishing gradients: norm below its usual range, against the other layers'",
    "too_fast": "learning too fast: update ratio above its usual range, against the other layers'",
    "too_slow": "learning too slowly: update ratio below its usual range, against the other layers'",
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
            ``cusum`` is not positive, ``window`` is not an int of at least 4 or ``min_points``
            not an int from 3 to ``window``.
    """

    max_zero_fraction: float = 0.8
    level_factor: float = 1.25
    norm_factor: float = 4.0
    ratio_factor: float = 4.0
    cusum: float = 5.0
    window: int = 32
    min_points: int = 24
    max_attention_logit: float = 30.0
    min_entropy_fraction: float = 0.1
    max_output_logit: float = 100.0
    max_massive_ratio: float = 1e4
    output_grad_factor: float = 4.0

    def __post_init__(self) -> None:
        check_number("max_zero_fraction", self.max_zero_fraction, 0.0, high=1.0)
        for name in ("level_factor", "norm_factor", "ratio_factor", "output_grad_factor"):
            check_number(name, getattr(self, name), 1.0)
        check_number("cusum", self.cusum, 0.0)
        check_int("window", self.window, low=4, high=MAX_WINDOW)
        check_int("min_points", self.min_points, low=3)
        if self.min_points > self.window:
            raise ValueError(f"`min_points` must be at most `window` ({self.window}), got {self.min_points}: "
                             f"lower it, or raise `window`")
        for name in ("max_attention_logit", "max_output_logit", "max_massive_ratio"):
            check_number(name, getattr(self, name), 0.0)
        check_number("min_entropy_fraction", self.min_entropy_fraction, 0.0, high=1.0)

    def titles(self) -> dict[str, str]:
        """Each problem's heading, with its threshold."""
        return {key: text.format(**vars(self)) for key, text in PROBLEMS.items()}
