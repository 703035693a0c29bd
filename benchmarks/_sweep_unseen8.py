"""The fault sweep's eighth unseen groups, ``unseen8`` to ``unseen8d``: the abrupt faults on the later models.

The ``unseen4`` and ``unseen5`` models ran mostly with a ramp and a jump; these groups give them the zoo's abrupt
faults they had not had (``dead``, ``vanish``, ``lr100``, ``nan``, ``data``, ``gradvanish``: the gradient reaching
the ``vanish`` module's output cut x1e-6; and ``attn``, one block's queries growing 4% a step, on the attention
models), each with its healthy twin, at seed 0:

- ``unseen8``: Phi, Falcon, BLOOM, GPT-BigCode, Gemma.
- ``unseen8b``: DistilBERT, RoBERTa, Qwen3, the LLaMA 16 blocks deep, GPT-J.
- ``unseen8c``: the ConvNeXt-style CNN, the U-Net, the autoencoder, the WaveNet-like stack, the MoE, the Mixer,
  the LSTMs.
- ``unseen8d``: a second position per transformer: an attention output projection, a norm (pre-norm, post-norm,
  an embedding's), dead or NaN.
- ``unseen8e``: the LR x100 in an attention output projection, a pre-norm RMSNorm, a post-norm LayerNorm and a
  token embedding (recipes ``<model>~<module>``, whose ``lr100`` param group is that module); the gradient cut
  at an attention output projection; a pre-norm RMSNorm's weights shrunk; a token embedding dead.
- ``unseen8f`` (added after the judge's first-module rule, to try it where it was not built): the LR x100 in the
  first module of the Qwen3, the Falcon (token embeddings), the MLP (Adam) and the CNN (SGD); a token embedding
  dead in the Falcon and the Qwen3.

The ``attn`` fault grows a fused q/k/v projection where the model has one (BLOOM), else the queries.
"""

from __future__ import annotations

from dataclasses import replace

from benchmarks import _sweep_unseen5  # noqa: F401  (adds the unseen4 and unseen5 recipes)
from benchmarks._sweep_variant import Variant
from benchmarks._zoo_models import RECIPES

QUERIES = {"bloom": "net.transformer.h.2.self_attention.query_key_value",
           "distilbert": "net.distilbert.transformer.layer.2.attention.q_lin",
           "roberta": "net.roberta.encoder.layer.2.attention.self.query",
           "llama16": "net.model.layers.8.self_attn.q_proj"}
for _model, _query in QUERIES.items():  # the recipes had no ``attn`` target
    RECIPES[_model] = replace(RECIPES[_model], targets={**RECIPES[_model].targets, "attn": _query})


def _faults(*faults: str) -> tuple[str, ...]:
    return ("healthy", *faults)


def _first() -> list[Variant]:
    faults = {"phi": ("vanish", "lr100", "nan", "gradvanish"),
              "falcon": ("dead", "vanish", "nan", "data", "gradvanish"),
              "bloom": ("dead", "lr100", "nan", "data", "gradvanish", "attn"),
              "bigcode": ("dead", "vanish", "lr100", "data", "gradvanish"),
              "gemma": ("vanish", "nan", "data", "gradvanish")}
    return [Variant("unseen8", m, _faults(*f)) for m, f in faults.items()]


def _second() -> list[Variant]:
    faults = {"distilbert": ("dead", "vanish", "lr100", "nan", "data", "gradvanish", "attn"),
              "roberta": ("dead", "vanish", "lr100", "nan", "gradvanish", "attn"),
              "qwen3": ("dead", "vanish", "lr100", "nan", "data", "gradvanish"),
              "llama16": ("vanish", "lr100", "nan", "data", "gradvanish", "attn"),
              "gptj": ("dead", "nan", "gradvanish", "attn")}
    return [Variant("unseen8b", m, _faults(*f)) for m, f in faults.items()]


def _others() -> list[Variant]:
    faults = {"convnext": ("dead", "vanish", "lr100", "nan", "data", "gradvanish"),
              "unet": ("dead", "nan", "gradvanish"), "autoenc": ("lr100", "nan", "gradvanish"),
              "wavenet": ("vanish", "gradvanish"), "moe": ("dead", "gradvanish"), "mixer": ("gradvanish",),
              "lstm": ("vanish", "gradvanish")}
    return [Variant("unseen8c", m, _faults(*f)) for m, f in faults.items()]


def _positions() -> list[Variant]:
    blk = "net.model.layers.2"
    return [Variant("unseen8d", "phi", ("dead",), target=f"{blk}.self_attn.dense"),  # attention's output projection
            Variant("unseen8d", "qwen3", ("dead",), target=f"{blk}.self_attn.o_proj"),
            Variant("unseen8d", "gptj", ("nan",), target="net.transformer.h.2.attn.out_proj"),
            Variant("unseen8d", "falcon", ("dead",), target="net.transformer.h.2.self_attention.dense"),
            Variant("unseen8d", "gemma", ("dead",), target=f"{blk}.post_attention_layernorm"),  # a pre-norm RMSNorm
            Variant("unseen8d", "roberta", ("dead",), target="net.roberta.encoder.layer.2.attention.output.LayerNorm"),
            Variant("unseen8d", "distilbert", ("dead",), target="net.distilbert.embeddings.LayerNorm"),  # embedding's
            Variant("unseen8d", "llama16", ("nan",), target="net.model.layers.8.input_layernorm")]


def _lr_at(model: str, module: str) -> str:
    """A recipe ``<model>~<module's last name>`` whose ``lr100`` param group is ``module``."""
    name = f"{model}~{module.rsplit('.', 1)[-1]}"
    RECIPES[name] = replace(RECIPES[model], name=name, targets={**RECIPES[model].targets, "lr100": module})
    return name


def _elsewhere() -> list[Variant]:
    blk = "net.model.layers.2"
    lr = [Variant("unseen8e", _lr_at(m, t), ("lr100",)) for m, t in
          (("qwen3", f"{blk}.self_attn.o_proj"), ("gemma", f"{blk}.post_attention_layernorm"),
           ("roberta", "net.roberta.encoder.layer.2.attention.output.LayerNorm"), ("bigcode", "net.transformer.wte"))]
    return [*lr, Variant("unseen8e", "phi", ("gradvanish",), target=f"{blk}.self_attn.dense"),
            Variant("unseen8e", "llama16", ("vanish",), target="net.model.layers.8.post_attention_layernorm"),
            Variant("unseen8e", "gptj", ("dead",), target="net.transformer.wte")]


def _first_modules() -> list[Variant]:
    lr = [Variant("unseen8f", _lr_at(m, t), ("lr100",)) for m, t in
          (("qwen3", "net.model.embed_tokens"), ("falcon", "net.transformer.word_embeddings"), ("mlp", "0"),
           ("cnn", "stem.0"))]
    return [*lr, Variant("unseen8f", "falcon", ("dead",), target="net.transformer.word_embeddings"),
            Variant("unseen8f", "qwen3", ("dead",), target="net.model.embed_tokens")]


def unseen8() -> dict[str, list[Variant]]:
    """The groups: ``unseen8``, ``unseen8b`` (transformers' faults), ``unseen8c`` (the others'), ``unseen8d``-``f``."""
    return {"unseen8": _first(), "unseen8b": _second(), "unseen8c": _others(), "unseen8d": _positions(),
            "unseen8e": _elsewhere(), "unseen8f": _first_modules()}
