"""The fault sweep's fourth unseen groups, ``unseen4``, ``unseen4b`` and ``unseen4c`` (issue 29, item 2).

Added after the judge passed the ``unseen3`` groups, none of it seen while building it
(models in ``benchmarks/_sweep_models4.py``):

- ``unseen4``: models: a Phi, a Falcon (multi-query, parallel), a BLOOM (ALiBi), a GPT-BigCode
  (multi-query), a Gemma, a DistilBERT and a RoBERTa from ``transformers`` configs; a WaveNet-like
  stack of gated dilated causal convolutions, torch's post-norm ``nn.TransformerEncoder``, a U-Net-like
  denoiser (skip concatenations, MSE), an MLP autoencoder (MSE), a mixture-of-experts MLP with a router.
- ``unseen4b``: positions: BLOOM's LayerNorm on the embedding, GPT-BigCode's token embedding, the MoE's
  router, the encoder's first norm (post-norm), the U-Net's first convolution and the WaveNet's, a
  WaveNet skip branch, a Gemma RMSNorm.
- ``unseen4c``: optimizers at a constant LR: RMSprop (MLP), Adagrad (CNN), SGD without momentum
  (MLP classifier), ``torch.optim.Adafactor`` (GPT-2).
- ``unseen4d``: the new models at a ramp of 1% a step, jumps x3 and x0.3, logged every 5 over 300
  steps, onsets at 30%, their other faults (LR x100, vanish, NaN, data); RMSprop on the MoE,
  Adafactor on the LLaMA.
- ``unseen4e``: attention's tuple output (``nn.MultiheadAttention``), ramps in first modules, a
  router dead or vanishing, an embedding's norm shrunk; logged every step, and 600 healthy steps
  logged every 5; LR x100 under RMSprop, plain SGD, Adagrad and Adafactor.
- ``unseen4f``: one block's queries growing 4% a step (``attn``) in the Phi, Gemma, Falcon (a fused
  q/k/v: all of it grows) and GPT-BigCode (a fused multi-query ``c_attn``: its first third grows, half
  its queries).
"""

from __future__ import annotations

from benchmarks import _sweep_models4  # noqa: F401  (adds the recipes)
from benchmarks._sweep_variant import Variant

ABRUPT = ("ramp", "jump")


def _models() -> list[Variant]:
    faults = {"phi": ("dead", "data"), "falcon": ("lr100",), "bloom": ("vanish",), "bigcode": ("nan",),
              "gemma": ("dead",), "distilbert": (), "roberta": ("data",), "wavenet": ("dead",),
              "tfenc": ("vanish",), "unet": ("data",), "autoenc": ("dead",), "moe": ()}
    return [Variant("unseen4", m, ("healthy", *ABRUPT, *more)) for m, more in faults.items()]


def _positions() -> list[Variant]:
    return [Variant("unseen4b", "bloom", ABRUPT, target="net.transformer.word_embeddings_layernorm"),
            Variant("unseen4b", "bigcode", ("jump",), target="net.transformer.wte"),  # an embedding's output
            Variant("unseen4b", "moe", ABRUPT, target="moe.1.router"),
            Variant("unseen4b", "tfenc", ("jump",), target="net.encoder.layers.1.norm1"),  # a post-norm
            Variant("unseen4b", "unet", ("jump",), target="enc1"),  # the first convolution
            Variant("unseen4b", "wavenet", ("jump",), target="net.first"),
            Variant("unseen4b", "wavenet", ABRUPT, target="net.layers.2.skip"),  # a skip branch
            Variant("unseen4b", "gemma", ("ramp",), target="net.model.layers.2.input_layernorm")]


def _optimizers() -> list[Variant]:
    faults = ("healthy", *ABRUPT)
    return [Variant("unseen4c", "mlp", faults, optimizer="rmsprop", lr=1e-3),
            Variant("unseen4c", "cnn", faults, optimizer="adagrad", lr=0.05),
            Variant("unseen4c", "mlp-cls", faults, optimizer="plain-sgd", lr=0.05),
            Variant("unseen4c", "gpt2", faults, optimizer="adafactor", lr=1e-2)]


def _harder() -> list[Variant]:
    rates = [Variant("unseen4d", m, ("ramp",), growth=1.01) for m in ("phi", "wavenet", "unet", "moe")]
    rates += [Variant("unseen4d", m, ("jump",), jump=j) for m, j in
              (("roberta", 3.0), ("autoenc", 3.0), ("wavenet", 0.3), ("moe", 0.3))]
    timing = [Variant("unseen4d", m, ("healthy", "ramp"), every=5, steps=300) for m in ("bloom", "gemma", "tfenc")]
    timing += [Variant("unseen4d", m, ("jump",), onset=0.3) for m in ("falcon", "distilbert")]
    faults = [Variant("unseen4d", "wavenet", ("lr100", "nan", "data")),
              Variant("unseen4d", "unet", ("lr100", "vanish")),
              Variant("unseen4d", "moe", ("lr100", "vanish", "nan", "data")), Variant("unseen4d", "gemma", ("lr100",)),
              Variant("unseen4d", "autoenc", ("vanish", "data")), Variant("unseen4d", "tfenc", ("nan", "data")),
              Variant("unseen4d", "moe", ("healthy", *ABRUPT), optimizer="rmsprop", lr=1e-3),
              Variant("unseen4d", "llama", ("healthy", *ABRUPT), optimizer="adafactor", lr=1e-2)]
    return [*rates, *timing, *faults]


def _more() -> list[Variant]:
    places = [Variant("unseen4e", "tfenc", ABRUPT, target="net.encoder.layers.1.self_attn"),  # a tuple output
              Variant("unseen4e", "unet", ("ramp",), target="enc1"),
              Variant("unseen4e", "bigcode", ("ramp", "nan"), target="net.transformer.wte"),
              Variant("unseen4e", "moe", ("dead", "vanish"), target="moe.1.router"),
              Variant("unseen4e", "bloom", ("vanish",), target="net.transformer.word_embeddings_layernorm")]
    every = [Variant("unseen4e", "wavenet", ("healthy", "jump"), every=1),
             Variant("unseen4e", "unet", ("healthy", "ramp"), every=1)]
    every += [Variant("unseen4e", m, ("healthy",), every=5, steps=600) for m in ("phi", "falcon", "bigcode")]
    every += [Variant("unseen4e", "gemma", ("jump",), every=5, steps=300, jump=3.0),
              Variant("unseen4e", "distilbert", ("ramp",), every=5, steps=300)]
    lr = [Variant("unseen4e", "mlp", ("lr100",), optimizer="rmsprop", lr=1e-3),
          Variant("unseen4e", "mlp-cls", ("lr100",), optimizer="plain-sgd", lr=0.05),
          Variant("unseen4e", "cnn", ("lr100",), optimizer="adagrad", lr=0.05),
          Variant("unseen4e", "gpt2", ("lr100",), optimizer="adafactor", lr=1e-2)]
    return [*places, *every, *lr]


def unseen4() -> dict[str, list[Variant]]:
    """The groups: ``unseen4`` (models), ``unseen4b`` (positions), ``unseen4c`` (optimizers), ``unseen4d``, ``e``."""
    attn = [Variant("unseen4f", m, ("attn",)) for m in ("phi", "falcon", "gemma", "bigcode")]  # queries grow
    return {"unseen4": _models(), "unseen4b": _positions(), "unseen4c": _optimizers(), "unseen4d": _harder(),
            "unseen4e": _more(), "unseen4f": attn}
