"""The fault sweep's tenth unseen groups, ``unseen10`` and ``unseen10b``: small batches, high rates, long runs.

A healthy run is judged by its own noise: a small batch makes every figure noisier, a high learning
rate makes every layer move faster, a long run gives the judge a longer history to drift against.
On the zoo's models and the wider ones of ``unseen9`` (``benchmarks/_sweep_unseen9.py``), at seed 0:

- ``unseen10``: batches of 2, 4, 8 and 16 (healthy, and a ramp or a jump beside it).
- ``unseen10b``: learning rates 3-10x the recipe's (healthy, and a jump), 600-step runs (healthy and a
  ramp at step 300), a 32-channel CNN at batch 8.
"""

from __future__ import annotations

from benchmarks import _sweep_unseen9  # noqa: F401  (adds the unseen9 recipes)
from benchmarks._sweep_variant import Variant


def _batches() -> list[Variant]:
    return [*(Variant("unseen10", "mlp-wide", ("healthy", "ramp"), batch=b) for b in (2, 8, 16)),
            Variant("unseen10", "mlp", ("healthy", "ramp"), batch=2),
            *(Variant("unseen10", "cnn", ("healthy", "jump"), batch=b) for b in (4, 8)),
            Variant("unseen10", "gpt2", ("healthy", "ramp"), batch=2),
            Variant("unseen10", "gpt2-w192", ("healthy", "jump"), batch=2),
            Variant("unseen10", "llama", ("healthy", "ramp"), batch=2)]


def _rates_and_lengths() -> list[Variant]:
    return [Variant("unseen10b", "llama-w128", ("healthy", "jump"), lr=3e-3),
            Variant("unseen10b", "mlp-wide", ("healthy", "jump"), lr=1e-2),
            Variant("unseen10b", "mlp", ("healthy", "jump"), lr=5e-3),
            Variant("unseen10b", "cnn-w32", ("healthy", "jump"), lr=0.2),
            Variant("unseen10b", "gpt2", ("healthy", "jump"), lr=5e-3),
            *(Variant("unseen10b", m, ("healthy", "ramp"), steps=600, growth=1.02) for m in ("mlp-wide", "cnn-w32")),
            Variant("unseen10b", "cnn-w32", ("healthy", "ramp"), batch=8)]


def unseen10() -> dict[str, list[Variant]]:
    """The groups: ``unseen10`` (small batches), ``unseen10b`` (high learning rates, long runs)."""
    return {"unseen10": _batches(), "unseen10b": _rates_and_lengths()}
