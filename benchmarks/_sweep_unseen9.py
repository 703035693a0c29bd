"""The fault sweep's ninth unseen groups, ``unseen9`` and ``unseen9b``: wider and deeper models.

Every earlier model is 64 wide (the zoo's ``WIDTH``) and at most 16 blocks deep. A wider layer
averages more values into each figure (less noise per row), a deeper model has more peers and
more victims downstream of a fault. Models built here, from ``transformers`` configs or by hand:

- ``gpt2-w192``: a GPT-2 192 wide (6 heads), 6 blocks; the faults in block 3.
- ``llama-w128``: a LLaMA 128 wide, 8 blocks, grouped-query attention (4 heads, 2 key/value); block 4.
- ``gpt2-12``: a GPT-2 64 wide and 12 blocks deep (the issue's own shape); block 6.
- ``mlp-wide``: the zoo's MLP 256 wide (Adam); its fourth Linear.
- ``cnn-w32``: the zoo's CNN 32 channels wide (SGD); its second block's first convolution.

Groups, each fault beside its healthy twin, at seed 0:

- ``unseen9``: every zoo fault on each model.
- ``unseen9b``: the issue's case (``gpt2-12``, 300 steps, a ramp of 3.4% a step from step 150), ramps of
  1% and 3% a step and a jump x3 on the wide GPT-2 and LLaMA, healthy runs of the wide GPT-2 at
  AdamW 3e-4 and 3e-3, the wide MLP at batch 4.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from benchmarks._sweep_models4 import _targets
from benchmarks._sweep_variant import Variant
from benchmarks._zoo_models import (
    CNN,
    LM,
    RECIPES,
    SEQ,
    SWEEP_LMS,
    VOCAB,
    Recipe,
    gpt2,
    image_batches,
    lm_batches,
    mlp,
    regression_batches,
)


def _llama(t: Any) -> nn.Module:
    return t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ))


def _gpt2_targets(block: int) -> dict[str, str]:
    h = f"net.transformer.h.{block}"
    return {**_targets(f"{h}.mlp.c_proj", f"{h}.mlp.c_fc"), "attn": f"{h}.attn.c_attn"}


SWEEP_LMS.update({"gpt2-w192": partial(gpt2, width=192, layers=6, heads=6), "gpt2-12": partial(gpt2, layers=12),
                  "llama-w128": _llama})
_LLAMA = "net.model.layers.4"
RECIPES.update({
    "gpt2-w192": Recipe("gpt2-w192", lambda: LM("gpt2-w192"), lm_batches, "lm", "adamw", 1e-3, 8, _gpt2_targets(3)),
    "gpt2-12": Recipe("gpt2-12", lambda: LM("gpt2-12"), lm_batches, "lm", "adamw", 1e-3, 8, _gpt2_targets(6)),
    "llama-w128": Recipe("llama-w128", lambda: LM("llama-w128"), lm_batches, "lm", "adamw", 6e-4, 8, {
        **_targets(f"{_LLAMA}.mlp.down_proj", f"{_LLAMA}.mlp.up_proj"), "attn": f"{_LLAMA}.self_attn.q_proj"}),
    "mlp-wide": Recipe("mlp-wide", lambda: mlp(256), regression_batches, "mse", "adam", 1e-3, 32, _targets("6")),
    "cnn-w32": Recipe("cnn-w32", lambda: CNN(32), image_batches, "ce", "sgd", 0.05, 32, _targets("blocks.1.conv1")),
})

ALL = ("healthy", "ramp", "jump", "dead", "vanish", "lr100", "nan", "data")


def unseen9() -> dict[str, list[Variant]]:
    """The groups: ``unseen9`` (every fault on the wider and deeper models), ``unseen9b`` (rates, LRs, more)."""
    first = [Variant("unseen9", m, (*ALL, "attn", "gradvanish")) for m in ("gpt2-w192", "llama-w128")]
    first += [Variant("unseen9", "gpt2-12", (*ALL, "attn")),
              *(Variant("unseen9", m, (*ALL, "gradvanish")) for m in ("mlp-wide", "cnn-w32"))]
    second = [Variant("unseen9b", "gpt2-12", ("healthy", "ramp"), steps=300, growth=1.034),
              *(Variant("unseen9b", m, ("ramp",), growth=g) for m in ("gpt2-w192", "llama-w128") for g in (1.01, 1.03)),
              *(Variant("unseen9b", m, ("jump",), jump=3.0) for m in ("gpt2-w192", "llama-w128")),
              *(Variant("unseen9b", "gpt2-w192", ("healthy", "ramp"), lr=lr) for lr in (3e-4, 3e-3)),
              Variant("unseen9b", "mlp-wide", ("healthy", "ramp", "jump"), batch=4)]
    return {"unseen9": first, "unseen9b": second}
