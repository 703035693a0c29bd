"""The fault sweep's eleventh unseen groups, ``unseen11`` and ``unseen11b``: other activations, dropout, noise.

Every earlier MLP used ReLU. Here the zoo's MLP (Adam, regression) with GELU, SiLU and Tanh between
its Linear layers, and with ReLU and dropout (p = 0.1) after each; then healthy runs long and noisy
on the wider models of ``unseen9`` (``benchmarks/_sweep_unseen9.py``) and a few models of earlier
groups at small batches, at seed 0:

- ``unseen11``: each activation's MLP with every zoo fault but attention's and its healthy twin.
- ``unseen11b``: the wide GPT-2 at batch 2 over 400 steps logged every step, the wide LLaMA over 500 steps
  logged every 5, the LSTMs, the ViT and the plain CNN at batch 4 (healthy, and a jump), the GELU MLP at
  batch 2 (healthy, and a ramp).
"""

from __future__ import annotations

from functools import partial

from torch import nn

from benchmarks import _sweep_unseen9  # noqa: F401  (adds the unseen9 recipes)
from benchmarks._sweep_models4 import _targets
from benchmarks._sweep_variant import Variant
from benchmarks._zoo_models import RECIPES, Recipe, mlp, regression_batches

for _name, _build, _third in (("mlp-gelu", partial(mlp, activation=nn.GELU), "4"),
                              ("mlp-silu", partial(mlp, activation=nn.SiLU), "4"),
                              ("mlp-tanh", partial(mlp, activation=nn.Tanh), "4"),
                              ("mlp-drop", partial(mlp, dropout=0.1), "6")):
    RECIPES[_name] = Recipe(_name, _build, regression_batches, "mse", "adam", 1e-3, 32, _targets(_third))

ALL = ("healthy", "ramp", "jump", "dead", "vanish", "lr100", "nan", "data")


def unseen11() -> dict[str, list[Variant]]:
    """The groups: ``unseen11`` (activations and dropout), ``unseen11b`` (long, noisy healthy runs)."""
    first = [Variant("unseen11", m, ALL) for m in ("mlp-gelu", "mlp-silu", "mlp-tanh", "mlp-drop")]
    second = [Variant("unseen11b", "gpt2-w192", ("healthy", "ramp"), batch=2, steps=400, every=1, growth=1.02),
              Variant("unseen11b", "llama-w128", ("healthy", "ramp"), steps=500, every=5, growth=1.02),
              *(Variant("unseen11b", m, ("healthy", "jump"), batch=4) for m in ("lstm", "vit", "cnn-plain")),
              Variant("unseen11b", "mlp-gelu", ("healthy", "ramp"), batch=2)]
    return {"unseen11": first, "unseen11b": second}
