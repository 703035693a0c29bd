"""The fault sweep's third unseen groups, ``unseen3`` and ``unseen3b`` (issue 29, item 2).

Added after the judge passed every earlier group, none of it seen while building it:

- ``unseen3``: models (a GPT-J from its ``transformers`` config: parallel residual from one shared
  LayerNorm; the GPT-2 ten blocks deep, the fault in block 5; an MLP classifier with cross-entropy;
  a pre-activation ResNet without normalisation; an MLP-Mixer; a ConvNeXt-style CNN, the fault also
  in a depthwise convolution) and layers (LLaMA's value projection, its first block's and last
  block's MLP output, GPT-2's prediction layer ``lm_head``).
- ``unseen3b``: rates (ramps of 0.7% and 3% a step, a shrink x0.3 and a jump x10), an onset at 35%,
  AdamW with weight decay 0.1 at a constant LR without warm-up (``adamw-flat``), and the zoo's own
  models and faults at new seeds (1-3).
- ``unseen3c``: the MLP-Mixer's other faults; a GPT-2 with dropout 0.1; GPT-J logged every step and
  600 steps logged every 5, the ten-block GPT-2 logged every 5; onsets at 25% (just past the
  judge's warm-up); a ramp of 0.3% a step; jumps x2.5 and x0.5; the MLP classifier's prediction
  layer, LLaMA's value projection dead, the deep GPT-2's first block, GPT-J's last attention output;
  the CNN with AdamW at a constant 3e-3; the pre-activation ResNet at seed 1.
"""

from __future__ import annotations

from benchmarks._sweep_variant import Variant

ABRUPT = ("ramp", "jump")


def _models() -> list[Variant]:
    llama = "net.model.layers"
    return [Variant("unseen3", "gptj", ("healthy", "ramp", "jump", "vanish", "lr100", "data")),
            Variant("unseen3", "gpt2-deep", ("healthy", "ramp", "jump", "dead")),
            Variant("unseen3", "mlp-cls", ("healthy", "ramp", "jump", "lr100")),
            Variant("unseen3", "resnet-preact", ("healthy", "ramp", "jump", "dead")),
            Variant("unseen3", "mixer", ("healthy", "ramp", "vanish")),
            Variant("unseen3", "convnext", ("healthy", "jump")),
            Variant("unseen3", "convnext", ABRUPT, target="blocks.1.dw"),  # a depthwise convolution
            Variant("unseen3", "llama", ABRUPT, target=f"{llama}.2.self_attn.v_proj"),  # a value projection
            Variant("unseen3", "llama", ("jump",), target=f"{llama}.0.mlp.down_proj"),  # the first block
            Variant("unseen3", "llama", ("ramp",), target=f"{llama}.5.mlp.down_proj"),  # the last block's MLP
            Variant("unseen3", "gpt2", ABRUPT, target="net.lm_head")]  # the prediction layer


def _recipes() -> list[Variant]:
    rates = [Variant("unseen3b", m, ("ramp",), growth=g) for m, g in
             (("gpt2", 1.007), ("cnn", 1.007), ("mlp", 1.03), ("llama", 1.03))]
    rates += [Variant("unseen3b", m, ("jump",), jump=j) for m, j in
              (("mlp", 0.3), ("gpt2", 0.3), ("cnn", 0.3), ("llama", 10.0), ("cnn", 10.0))]
    onsets = [Variant("unseen3b", "mlp", ("ramp",), onset=0.35), Variant("unseen3b", "gpt2", ("jump",), onset=0.35)]
    optim = [Variant("unseen3b", "mlp", ("healthy", *ABRUPT), optimizer="adamw-flat", lr=1e-3),
             Variant("unseen3b", "gpt2", ("healthy", "ramp"), optimizer="adamw-flat", lr=5e-4)]
    seeds = [Variant("unseen3b", "gpt2", ("healthy", "ramp", "vanish"), seed=1),
             Variant("unseen3b", "llama", ("healthy", "jump", "nan"), seed=2),
             Variant("unseen3b", "cnn", ("healthy", "ramp", "dead"), seed=3),
             Variant("unseen3b", "mlp", ("healthy", "jump", "lr100"), seed=1)]
    return [*rates, *onsets, *optim, *seeds]


def _harder() -> list[Variant]:
    mixer = [Variant("unseen3c", "mixer", ("jump", "dead", "lr100", "nan", "data"))]
    models = [Variant("unseen3c", "gpt2-dropout", ("healthy", "ramp", "jump", "dead")),
              Variant("unseen3c", "gptj", ("healthy", "jump"), every=1),
              Variant("unseen3c", "gpt2-deep", ("healthy", "ramp"), every=5, steps=300),
              Variant("unseen3c", "gptj", ("healthy", "ramp"), every=5, steps=600),
              Variant("unseen3c", "mixer", ("healthy",), every=5, steps=600)]
    timing = [Variant("unseen3c", m, ("jump",), onset=0.25) for m in ("mlp", "cnn", "gpt2")]
    timing += [Variant("unseen3c", m, ("ramp",), growth=1.003) for m in ("mlp", "gpt2")]
    timing += [Variant("unseen3c", m, ("jump",), jump=j) for m, j in (("cnn", 2.5), ("llama", 2.5), ("gpt2", 0.5))]
    layers = [Variant("unseen3c", "mlp-cls", ABRUPT, target="9"),  # the prediction layer (Adam)
              Variant("unseen3c", "llama", ("dead",), target="net.model.layers.2.self_attn.v_proj"),
              Variant("unseen3c", "gpt2-deep", ("ramp",), target="net.transformer.h.0.mlp.c_proj"),
              Variant("unseen3c", "gptj", ("jump",), target="net.transformer.h.5.attn.out_proj")]
    optim = [Variant("unseen3c", "cnn", ("healthy", *ABRUPT), optimizer="adamw-flat", lr=3e-3),
             Variant("unseen3c", "resnet-preact", ("healthy", "ramp"), seed=1)]
    return [*mixer, *models, *timing, *layers, *optim]


def unseen3() -> dict[str, list[Variant]]:
    """The groups: ``unseen3`` (models and layers), ``unseen3b`` (rates, onset, optimizer, seeds), ``unseen3c``."""
    return {"unseen3": _models(), "unseen3b": _recipes(), "unseen3c": _harder()}
