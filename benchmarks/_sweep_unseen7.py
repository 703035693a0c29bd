"""The fault sweep's seventh unseen groups, ``unseen7`` to ``unseen7d`` (issue 29, item 2).

Positions, rates, onsets and schedules no earlier group held, on models the judge has seen (the zoo's four,
Qwen2); none of it seen while building the judge:

- ``unseen7``: the zoo's four models (MLP, CNN, GPT-2, LLaMA) at seeds 4 and 5 (a ramp, a jump, the healthy twin).
- ``unseen7b``: positions: LLaMA's head (the last module) and its final RMSNorm, a GPT-2 block's whole output
  (the residual stream after the block), a BatchNorm's own output and the CNN's head, Qwen2's first and last
  block's MLP output.
- ``unseen7c``: ramps of 8%, 12% and 20% a step (near a jump), jumps x1.3 and x0.75 (graded as ramps), a ramp
  of 4% a step that stops after 20 steps and holds (x2.2), onsets at 12% and 15% (before the judge's ranges
  settle) and at 95%.
- ``unseen7d``: schedules: AdamW at 3e-3 (warm-up and cosine), AdamW with linear decay to 0, a one-cycle LR, a
  warm-up over 40% of the run, AdamW at a constant LR on LLaMA; healthy runs of 400-500 steps logged every step.
- ``unseen7e``, added with the judge's warm-up jump rule (seen after it): jumps x10 and x5, a dead module and a bad
  batch at 12-15% of the run, ramps from 20%, healthy MLPs logged every step under RMSprop and AdamW at 3e-3 without
  warm-up (large first steps).
- ``unseen7f``, added after the rule: one-cycle on GPT-2 and the CNN, linear decay on LLaMA, a 40% warm-up on
  Qwen2 at 3e-3, healthy LLaMA (500 steps) and Qwen2 (400) logged every step.
"""

from __future__ import annotations

from benchmarks import _sweep_models  # noqa: F401  (adds Qwen2)
from benchmarks._sweep_variant import Variant

ABRUPT = ("ramp", "jump")
FULL = ("healthy", *ABRUPT)
BLK = "net.model.layers"


def _seeds() -> list[Variant]:
    return [Variant("unseen7", m, FULL, seed=s) for s in (4, 5) for m in ("mlp", "cnn", "gpt2", "llama")]


def _positions() -> list[Variant]:
    return [Variant("unseen7b", "llama", ABRUPT, target="net.lm_head"),  # the LM head: the last module
            Variant("unseen7b", "llama", ABRUPT, target="net.model.norm"),  # the final RMSNorm
            Variant("unseen7b", "gpt2", ABRUPT, target="net.transformer.h.2"),  # the block's output (a tuple)
            Variant("unseen7b", "cnn", ABRUPT, target="blocks.1.bn1"),  # a BatchNorm's own output
            Variant("unseen7b", "cnn", ABRUPT, target="head"),  # the last module
            Variant("unseen7b", "qwen2", ABRUPT, target=f"{BLK}.0.mlp.down_proj"),  # the first block
            Variant("unseen7b", "qwen2", ABRUPT, target=f"{BLK}.5.mlp.down_proj")]  # the last block


def _settings() -> list[Variant]:
    rates = [Variant("unseen7c", m, ("ramp",), growth=g) for m, g in
             (("mlp", 1.08), ("llama", 1.08), ("cnn", 1.12), ("gpt2", 1.12), ("qwen2", 1.2), ("mlp", 1.2))]
    rates += [Variant("unseen7c", m, ("jump",), jump=j) for m, j in
              (("gpt2", 1.3), ("cnn", 1.3), ("llama", 1.3), ("mlp", 0.75), ("qwen2", 0.75), ("gpt2", 0.75))]
    rates += [Variant("unseen7c", m, ("ramp",), hold=20) for m in ("mlp", "cnn", "gpt2", "llama")]
    onsets = [Variant("unseen7c", m, ABRUPT, onset=f) for m, f in
              (("gpt2", 0.12), ("mlp", 0.12), ("cnn", 0.15), ("llama", 0.15), ("qwen2", 0.95), ("mlp", 0.95))]
    return [*rates, *onsets]


def _schedules() -> list[Variant]:
    return [Variant("unseen7d", "gpt2", FULL, optimizer="adamw", lr=3e-3),
            Variant("unseen7d", "llama", FULL, optimizer="adamw", lr=3e-3),
            Variant("unseen7d", "llama", FULL, optimizer="adamw-flat", lr=6e-4),  # no warm-up
            Variant("unseen7d", "gpt2", FULL, optimizer="adamw-linear", lr=1e-3),
            Variant("unseen7d", "cnn", FULL, optimizer="adamw-linear", lr=2e-3),
            Variant("unseen7d", "qwen2", FULL, optimizer="adamw-onecycle", lr=2e-3),
            Variant("unseen7d", "mlp", FULL, optimizer="adamw-onecycle", lr=3e-3),
            Variant("unseen7d", "gpt2", FULL, optimizer="adamw-warm40", lr=1e-3),
            Variant("unseen7d", "llama", ("healthy", "ramp"), optimizer="adamw-warm40", lr=6e-4),
            *(Variant("unseen7d", m, ("healthy",), steps=n, every=1) for m, n in
              (("mlp", 500), ("cnn", 500), ("gpt2", 400)))]


def _early() -> list[Variant]:
    return [*(Variant("unseen7e", m, ("jump",), onset=0.15, jump=j) for m, j in
              (("gpt2", 10.0), ("cnn", 10.0), ("mlp", 5.0))),
            Variant("unseen7e", "gpt2", ("dead",), onset=0.12),
            *(Variant("unseen7e", m, ("data",), onset=0.12) for m in ("gpt2", "cnn")),
            *(Variant("unseen7e", m, ("ramp",), onset=0.2) for m in ("gpt2", "cnn", "mlp")),
            Variant("unseen7e", "mlp", ("healthy",), optimizer="rmsprop", every=1),
            Variant("unseen7e", "mlp", ("healthy",), optimizer="adamw-flat", lr=3e-3, every=1)]


def _more() -> list[Variant]:
    return [Variant("unseen7f", "gpt2", FULL, optimizer="adamw-onecycle", lr=2e-3),
            Variant("unseen7f", "cnn", FULL, optimizer="adamw-onecycle", lr=2e-3),
            Variant("unseen7f", "llama", ("healthy", "jump"), optimizer="adamw-linear", lr=6e-4),
            Variant("unseen7f", "qwen2", ("healthy", "ramp"), optimizer="adamw-warm40", lr=3e-3),
            *(Variant("unseen7f", m, ("healthy",), steps=n, every=1) for m, n in (("llama", 500), ("qwen2", 400)))]


def unseen7() -> dict[str, list[Variant]]:
    """The groups: ``unseen7`` (seeds), ``unseen7b`` (positions), ``unseen7c`` (rates, onsets), ``unseen7d``
    (schedules), ``unseen7e`` (early onsets and fast first steps, added with the judge's warm-up jump rule),
    ``unseen7f`` (more schedules and long runs, added after it)."""
    return {"unseen7": _seeds(), "unseen7b": _positions(), "unseen7c": _settings(), "unseen7d": _schedules(),
            "unseen7e": _early(), "unseen7f": _more()}
