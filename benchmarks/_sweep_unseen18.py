"""The fault sweep's eighteenth to twenty-first unseen groups: faults drawn at random, in layers nobody chose.

- ``unseen18``: 48 faulty cases, each drawn (``random.Random(18)``) from 24 models, any module with weights from the
  middle 60% of the model (a Linear, a convolution, a norm of torch's or four RMSNorms; not an embedding, not the
  head), a ramp (1-6% a step) or a jump (x4 to x40), each drawn 3 times as often as dead units, a vanishing signal
  or a NaN, an onset at 30-70% of a 300-step run, logged every 2 steps (every 5 drawn one time in 4); and each
  drawn recipe's healthy run.
- ``unseen19``: drawn the same way (``random.Random(19)``), after the judge was changed on ``unseen18``: a check on
  cases the change was not made on.
- ``unseen20``: drawn the same way (``random.Random(20)``) from 28 other models: encoder-decoders, a Mamba, mixtures of
  experts, recurrent and convolutional LMs, MLPs with other activations, wider and plainer CNNs.
- ``unseen21``: drawn the same way (``random.Random(21)``) from all 52 models, after the rules written on
  ``unseen18`` to ``unseen20``.
"""

from __future__ import annotations

import functools
import random

from torch import nn

from benchmarks._sweep_variant import Variant
from benchmarks._zoo_models import RECIPES

#: The models drawn from: the zoo's four and twenty of the sweep's (no shared modules: their known limits).
MODELS = ("gpt2", "llama", "cnn", "mlp", "qwen2", "opt", "gptj", "bert", "neox", "phi", "falcon", "gemma", "mistral",
          "stablelm", "vit", "mixer", "convnext", "resnet-preact", "cnn-gn", "mlp-deep-ln", "mobilenet", "densenet",
          "gnn", "unet")
#: ``unseen20``'s models: the sweep's others.
OTHER_MODELS = ("t5", "bart", "mamba", "mixtral", "qwen3", "cohere", "roberta", "distilbert", "bloom", "bigcode",
                "gpt2-12", "llama16", "gpt2-dropout", "gru", "lstm", "wavenet", "tfenc", "moe", "moe-top1", "autoenc",
                "mlp-gelu", "mlp-silu", "mlp-tanh", "mlp-wide", "cnn-w32", "cnn-plain", "resnet-tv", "mlp-cls")
FAULTS = ("ramp", "jump", "dead", "vanish", "nan")
WEIGHTS = (3, 3, 1, 1, 1)  # ramps and jumps drawn three times as often
CASES = 48
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm2d)
RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "GemmaRMSNorm", "MistralRMSNorm")


@functools.cache
def _eligible(recipe: str) -> tuple[str, ...]:
    """The recipe's modules with their own weight, in the order they were made, the first and last 20% left out.

    Built once per recipe (``fault_sweep.variants`` is called for every line of a comparison). The norms drawn are
    torch's and the RMSNorms of ``RMS_NORMS`` (the ones written when the groups were drawn: widening the list would
    change what the recorded groups hold).
    """
    names = []
    for name, module in RECIPES[recipe].build().named_modules():
        if not name or list(module.children()) or isinstance(module, nn.Embedding) or "head" in name:
            continue
        if getattr(module, "weight", None) is None or not isinstance(module.weight, nn.Parameter):
            continue
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, *_NORMS)) or type(module).__name__ in (
                "Conv1D", *RMS_NORMS):
            names.append(name)
    cut = len(names) // 5
    return tuple(names[cut: len(names) - cut])


def unseen18() -> dict[str, list[Variant]]:
    """The groups ``unseen18`` to ``unseen21``: random faults in random layers, and the drawn recipes' healthy runs."""
    return {"unseen18": _drawn("unseen18", 18, MODELS), "unseen19": _drawn("unseen19", 19, MODELS),
            "unseen20": _drawn("unseen20", 20, OTHER_MODELS), "unseen21": _drawn("unseen21", 21, MODELS + OTHER_MODELS)}


def _drawn(group: str, seed: int, models: tuple[str, ...]) -> list[Variant]:
    """``CASES`` faults on ``models`` drawn with ``random.Random(seed)``, and each drawn recipe's healthy run."""
    draw = random.Random(seed)
    cases, healthy = [], {}
    while len(cases) < CASES:
        model = draw.choice(models)
        if not _eligible(model):  # nothing to hurt (an RNN's weights are no ``weight``): drawn again
            continue
        target, fault = draw.choice(_eligible(model)), draw.choices(FAULTS, WEIGHTS)[0]
        every, onset = draw.choice((2, 2, 2, 5)), round(draw.uniform(0.3, 0.7), 2)
        growth, jump = round(draw.uniform(1.01, 1.06), 3), round(draw.uniform(4.0, 40.0), 1)
        v = Variant(group, model, (fault,), target=target, steps=300, onset=onset, every=every, growth=growth,
                    jump=jump)
        cases.append(v)
        healthy.setdefault((model, every), Variant(group, model, ("healthy",), steps=300, every=every))
    return [*healthy.values(), *cases]
