"""Which parameter rows the judge takes apart, read from the model: the 1-D rows, and the norms' scales among them.

LayerHealth judges by them, and GradientMonitor writes them beside its update ratios for the Layers tab
(``UNJUDGED_RATIOS_TAG``), so that both judge the same rows the same way (``judged_figure``).
"""

from __future__ import annotations

from typing import Any

from lightning_hooks.core.selection import clean_name, named_parameters
from lightning_hooks.output._findings import owner_of


def unjudged_ratios(pl_module: Any) -> set[str]:
    """The rows whose update ratio is not judged: ``pl_module``'s 1-D parameters but its norms' scales.

    Their few small entries give large, noisy ratios on healthy runs (a bias or a PReLU's slope crossing
    0); a module row holds its weights too, and is judged. Names as the monitors write them (``clean_name``).
    """
    scales = norm_scales(pl_module)
    return {name for name, param in named_parameters(pl_module) if param.ndim < 2 and name not in scales}


def norm_scales(pl_module: Any) -> set[str]:
    """The rows of ``pl_module``'s norms' scales: the 1-D ``weight`` of a module whose class is a norm.

    A norm is a class named ``*Norm*`` (``LayerNorm``, ``BatchNorm2d``, ``GroupNorm``, ``RMSNorm``, a
    ``transformers`` model's ``LlamaRMSNorm``...). Their update ratio is judged apart
    (``output._health_verdicts.judged_figure``).
    """
    norms = {clean_name(name) for name, module in pl_module.named_modules() if "Norm" in type(module).__name__}
    return {name for name, param in named_parameters(pl_module)
            if param.ndim == 1 and name.rpartition(".")[2] == "weight" and owner_of(name) in norms}
