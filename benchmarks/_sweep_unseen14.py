"""The fault sweep's fourteenth unseen groups, ``unseen14`` and ``unseen14b``: faults where the newer excuses apply.

Four rules added with ``unseen9`` ... ``unseen13`` excuse a move as learning: a lean's pace read over its newest
points, most outputs zero held 3 points before it is dead, a gain the next copy's gain shares, the prediction
layer's growth the loss asked for settling. Faults where each could hide a culprit, at seed 0:

- ``unseen14``: a ramp and a jump in the prediction layer: the wide MLP under SGD and Adam, the zoo's MLP under
  Adam, the 32-channel CNN's head, the wide GPT-2's ``lm_head``.
- ``unseen14b``: a ramp and a jump in the ViT's block 2 attention output projection (at batch 4, where it learns
  with block 3's, and at the recipe's batch); slow ramps (1% and 2% a step) on the wide MLP at batches 4 and 2.
"""

from __future__ import annotations

from benchmarks import _sweep_unseen9  # noqa: F401  (adds the unseen9 recipes)
from benchmarks._sweep_variant import Variant

ABRUPT = ("ramp", "jump")


def unseen14() -> dict[str, list[Variant]]:
    """The groups: ``unseen14`` (the prediction layer), ``unseen14b`` (a shared gain, small batches' slow ramps)."""
    first = [Variant("unseen14", "mlp-wide", ("healthy", *ABRUPT), target="10", optimizer="sgd", lr=0.02),
             Variant("unseen14", "mlp-wide", ABRUPT, target="10"), Variant("unseen14", "mlp", ABRUPT, target="10"),
             Variant("unseen14", "cnn-w32", ABRUPT, target="head"),
             Variant("unseen14", "gpt2-w192", ABRUPT, target="net.lm_head")]
    second = [Variant("unseen14b", "vit", ABRUPT, target="blocks.2.proj", batch=4),
              Variant("unseen14b", "vit", ABRUPT, target="blocks.2.proj"),
              Variant("unseen14b", "mlp-wide", ("ramp",), batch=4, growth=1.01),
              Variant("unseen14b", "mlp-wide", ("ramp",), batch=2, growth=1.02)]
    return {"unseen14": first, "unseen14b": second}
