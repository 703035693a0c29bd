"""The fault sweep's thirteenth unseen groups, ``unseen13`` and ``unseen13b``: the wider models' other settings.

The models of ``unseen9`` (``benchmarks/_sweep_unseen9.py``) with what the zoo's models had in earlier groups, at
seed 0:

- ``unseen13``: the 12-block GPT-2's fault in its second and eleventh block (a ramp and a jump), the wide GPT-2
  in bf16-mixed, with four micro-batches a step, with its gradients clipped to 1.
- ``unseen13b``: the wide LLaMA logged every 10 steps over 400, the wide MLP under SGD with momentum, the 32-channel
  CNN under AdamW (warm-up and cosine), each with an LR x100 beside.
"""

from __future__ import annotations

from benchmarks import _sweep_unseen9  # noqa: F401  (adds the unseen9 recipes)
from benchmarks._sweep_variant import Variant

ABRUPT = ("ramp", "jump")


def unseen13() -> dict[str, list[Variant]]:
    """The groups: ``unseen13`` (positions, precision, micro-batches, clipping), ``unseen13b`` (more)."""
    first = [*(Variant("unseen13", "gpt2-12", ABRUPT, target=f"net.transformer.h.{b}.mlp.c_proj") for b in (1, 10)),
             Variant("unseen13", "gpt2-w192", ("healthy", *ABRUPT), precision="bf16-mixed"),
             Variant("unseen13", "gpt2-w192", ("healthy", "jump"), accumulate=4),
             Variant("unseen13", "gpt2-w192", ("healthy", "ramp"), clip=1.0)]
    second = [Variant("unseen13b", "llama-w128", ("healthy", *ABRUPT), steps=400, every=10),
              Variant("unseen13b", "mlp-wide", ("healthy", *ABRUPT, "lr100"), optimizer="sgd", lr=0.02),
              Variant("unseen13b", "cnn-w32", ("healthy", *ABRUPT, "lr100"), optimizer="adamw", lr=2e-3)]
    return {"unseen13": first, "unseen13b": second}
