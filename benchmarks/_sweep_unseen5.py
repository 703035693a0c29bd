"""The fault sweep's fifth unseen groups, ``unseen5``, ``unseen5b`` and ``unseen5c`` (issue 29, item 2).

Added after the judge passed the ``unseen4`` groups, none of it seen while building it:

- ``unseen5``: the ``unseen4`` models at seeds 2 and 3 (a ramp, a jump, the healthy twin).
- ``unseen5b``: positions and models: a Qwen3 (RMSNorm on queries and keys) and its key norm, Phi's key
  projection, the GeGLU gate (Gemma) and the SwiGLU gate (LLaMA), an MoE expert's first Linear, a
  top-1 (switch-routed) MoE whose experts see only their tokens, post-norm and pre-norm LayerNorms
  (DistilBERT, Falcon, the MoE), the U-Net's convolution after its skip concatenation, a LLaMA 16
  blocks deep (width 32).
- ``unseen5c``: ramps of 2% and 6% a step, jumps x0.5, x1.8 (graded as a ramp) and x5, a shrink x0.2,
  onsets at 60% and 80%, logged every 4 and every 8, batch sizes 4 and 64, weight decay 0.1 under
  SGD, the gradients' norm clipped to 0.5.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import _sweep_models4  # noqa: F401  (adds the unseen4 recipes)
from benchmarks._sweep_models4 import MoE, MoEMLP, _lm, _targets
from benchmarks._sweep_variant import Variant
from benchmarks._zoo_models import RECIPES, SEQ, SWEEP_LMS, VOCAB, WIDTH, Recipe, regression_batches

ABRUPT = ("ramp", "jump")
FULL = ("healthy", *ABRUPT)


def _qwen3(t: Any) -> nn.Module:
    return t.Qwen3ForCausalLM(t.Qwen3Config(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, tie_word_embeddings=False))


def _llama16(t: Any) -> nn.Module:
    return t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=128, num_hidden_layers=16, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=SEQ))


SWEEP_LMS.update(qwen3=_qwen3, llama16=_llama16)


class SwitchMoE(MoE):
    """A top-1 (switch-routed) mixture of four expert MLPs: each expert runs on the rows routed to it only."""

    def forward(self, x: Tensor) -> Tensor:
        gate, pick = torch.softmax(self.router(x), dim=-1).max(dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (pick == i).nonzero().flatten()
            if len(rows) > 1:  # an expert given one row or none is skipped at the step (its std needs two)
                out[rows] = gate[rows, None] * expert(x[rows])
        return x + out


def switch_mlp() -> nn.Module:
    """The ``moe`` recipe's network with top-1 (switch) routing: 16 -> 1."""
    return MoEMLP(layer=SwitchMoE)


BLK = "net.model.layers"
RECIPES.update({
    "qwen3": _lm("qwen3", f"{BLK}.2.mlp.down_proj", f"{BLK}.2.mlp.up_proj", f"{BLK}.2.self_attn.q_proj"),
    "llama16": _lm("llama16", f"{BLK}.8.mlp.down_proj", f"{BLK}.8.mlp.up_proj"),
    "moe-top1": Recipe("moe-top1", switch_mlp, regression_batches, "mse", "adam", 1e-3, 32,
                       _targets("moe.1.experts.2.2", "moe.1.experts.2.0")),
})


def _seeds() -> list[Variant]:
    two = ("phi", "bloom", "gemma", "wavenet", "unet")
    three = ("falcon", "bigcode", "distilbert", "tfenc", "moe")
    return [*(Variant("unseen5", m, FULL, seed=2) for m in two), *(Variant("unseen5", m, FULL, seed=3) for m in three)]


def _positions() -> list[Variant]:
    return [Variant("unseen5b", "qwen3", (*FULL, "attn")),
            Variant("unseen5b", "qwen3", ABRUPT, target=f"{BLK}.2.self_attn.k_norm"),  # the keys' RMSNorm
            Variant("unseen5b", "phi", ABRUPT, target=f"{BLK}.2.self_attn.k_proj"),
            Variant("unseen5b", "gemma", ABRUPT, target=f"{BLK}.2.mlp.gate_proj"),  # GeGLU's gate
            Variant("unseen5b", "llama", ("ramp",), target=f"{BLK}.2.mlp.gate_proj"),  # SwiGLU's gate
            Variant("unseen5b", "moe", ABRUPT, target="moe.0.experts.1.0"),  # an expert's first Linear
            Variant("unseen5b", "moe-top1", FULL),
            Variant("unseen5b", "distilbert", ABRUPT, target="net.distilbert.transformer.layer.2.sa_layer_norm"),
            Variant("unseen5b", "falcon", ("jump",), target="net.transformer.h.2.input_layernorm"),
            Variant("unseen5b", "moe", ("ramp",), target="norms.1"),
            Variant("unseen5b", "unet", ABRUPT, target="dec"),  # the convolution after the skip concatenation
            Variant("unseen5b", "llama16", (*FULL, "dead"))]


def _settings() -> list[Variant]:
    rates = [Variant("unseen5c", m, ("ramp",), growth=g) for m, g in
             (("wavenet", 1.02), ("tfenc", 1.02), ("bloom", 1.06), ("unet", 1.06))]
    rates += [Variant("unseen5c", m, ("jump",), jump=j) for m, j in
              (("falcon", 0.5), ("autoenc", 0.5), ("roberta", 1.8), ("moe", 1.8), ("bigcode", 5.0),
               ("wavenet", 5.0), ("gemma", 0.2), ("unet", 0.2))]
    timing = [Variant("unseen5c", "phi", ABRUPT, onset=0.6), Variant("unseen5c", "distilbert", ABRUPT, onset=0.8),
              Variant("unseen5c", "bloom", FULL, every=4, steps=240),
              Variant("unseen5c", "unet", FULL, every=8, steps=480)]
    recipes = [Variant("unseen5c", "mlp", FULL, batch=4), Variant("unseen5c", "cnn", FULL, batch=64),
               Variant("unseen5c", "cnn", FULL, weight_decay=0.1), Variant("unseen5c", "gemma", FULL, clip=0.5)]
    return [*rates, *timing, *recipes]


def unseen5() -> dict[str, list[Variant]]:
    """The groups: ``unseen5`` (seeds), ``unseen5b`` (positions and models), ``unseen5c`` (rates and settings)."""
    return {"unseen5": _seeds(), "unseen5b": _positions(), "unseen5c": _settings()}
