"""Which parameter rows the judge takes apart, read from the model: the 1-D rows, and the norms' scales among them.

LayerHealth judges by them, and GradientMonitor writes them beside its update ratios for the Layers tab
(``UNJUDGED_RATIOS_TAG``), so that both judge the same rows the same way (``judged_figure``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_hooks.core.selection import clean_name, named_parameters
from lightning_hooks.output._findings import owner_of

#: The modules whose outputs are rows of their own weights, whatever the batch's scale: the embeddings (not an
#: ``EmbeddingBag``, whose sums and means scale with the bags).
LOOKUPS = (nn.Embedding,)


def lookups(pl_module: Any) -> dict[str, str]:
    """``pl_module``'s embeddings (:data:`LOOKUPS`), each with its weight's row, as the monitors name them.

    Their outputs only move as their weights learn: the judge lets a drift of theirs as far as their weights moved
    in as learning (``output._judge_learning``). A weight tied to another module's (BART's ``shared``) has the row
    of its first name, as the gradient monitor logs it.
    """
    first: dict[int, str] = {}
    for name, param in named_parameters(pl_module):  # each parameter once, under its first name
        first.setdefault(id(param), name)
    return {clean_name(name): first[id(module.weight)] for name, module in pl_module.named_modules()
            if isinstance(module, LOOKUPS) and id(module.weight) in first}


def judged_apart(pl_module: Any) -> tuple[set[str], set[str]]:
    """``pl_module``'s 1-D parameter rows, as the monitors name them (``clean_name``): unjudged, and norms' scales.

    A norm's scale is the 1-D ``weight`` of a module whose class is named ``*Norm*`` (``LayerNorm``,
    ``BatchNorm2d``, ``GroupNorm``, ``RMSNorm``, a ``transformers`` model's ``LlamaRMSNorm``...): its update
    ratio is judged apart (``output._health_verdicts.judged_figure``). The other 1-D rows' ratio is not judged:
    their few small entries give large, noisy ratios on healthy runs (a bias or a PReLU's slope crossing 0);
    a module row holds its weights too, and is judged.
    """
    norms = {clean_name(name) for name, module in pl_module.named_modules() if "Norm" in type(module).__name__}
    unjudged: set[str] = set()
    scales: set[str] = set()
    for name, param in named_parameters(pl_module):
        if param.ndim < 2:
            is_scale = param.ndim == 1 and name.rpartition(".")[2] == "weight" and owner_of(name) in norms
            (scales if is_scale else unjudged).add(name)
    return unjudged, scales
