"""The fault sweep's slow-ramp groups, ``creep`` and ``creep-long`` (issue 29: a ramp named before the loss moved 5%).

Ramps at 0.15%, 0.2%, 0.3% and 0.4% a step, around the judge's creep bound
(``CREEP_PER_STEP``, 0.3% a step, in ``lightning_hooks/output/_row_range.py``), on the zoo's
MLP, CNN, GPT-2 and LLaMA, with their healthy twins: what tells a slow faulty ramp from a
healthy layer's creep, and what the judge names (docs/verdicts.md). ``creep-long``: 400 steps,
the ramp over 200, so that a slow ramp has the time to move the loss of the larger models too.
"""

from __future__ import annotations

from benchmarks._sweep_variant import Variant

#: The ramps' growth a step: below, at and just above the creep bound.
RATES = (1.0015, 1.002, 1.003, 1.004)
MODELS = ("mlp", "cnn", "gpt2", "llama")


def creep() -> dict[str, list[Variant]]:
    """The groups: each model healthy, and ramped at each of ``RATES`` (``creep-long``: at two of them)."""
    healthy = [Variant("creep", m, ("healthy",)) for m in MODELS]
    long = [Variant("creep-long", m, ("healthy",), steps=400) for m in ("mlp", "cnn", "gpt2")]
    long += [Variant("creep-long", m, ("ramp",), steps=400, growth=g) for m in ("mlp", "cnn", "gpt2")
             for g in (1.002, 1.004)]
    return {"creep": healthy + [Variant("creep", m, ("ramp",), growth=g) for m in MODELS for g in RATES],
            "creep-long": long}
