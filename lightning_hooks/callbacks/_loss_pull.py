"""The prediction layer's pull: ``sum(y * dL/dy)`` of the last module's output ``y``, from its own parameters' gradients.

``sum(y * dL/dy)`` is the loss's derivative in the scale of ``y`` (``dL/dc`` at ``c = 1`` for
``c * y``): below 0 the loss asks for a larger output, above 0 a smaller one. A prediction layer
that grows because training pushes it (a slow optimizer fitting the targets' scale) has it below 0;
a fault that makes it overshoot has it above 0 while it grows on (docs/verdicts.md). For a module
whose output is linear in its own parameters (``y = W x + b``: a Linear, a convolution, an
embedding, a norm's affine) it is ``sum(<p, dL/dp>)`` over them, read from the gradients the step
has anyway: no activation hook, two small reductions on a logged step.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

#: Modules whose output is linear in their own parameters (weight and bias) taken together.
LINEAR_IN_PARAMETERS = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.Embedding, nn.LayerNorm, nn.GroupNorm,
                        nn.modules.batchnorm._NormBase)
#: The same, by class name, where the class is not importable here (``transformers``' GPT-2 ``Conv1D``).
LINEAR_BY_NAME = ("Conv1D",)


def own_parameters(root: nn.Module, name: str) -> Optional[list[Tensor]]:
    """The parameters of ``root``'s module ``name`` (not its children's), where ``sum(<p, dL/dp>)`` is its pull.

    None where the module is not linear in its own parameters (:data:`LINEAR_IN_PARAMETERS`), has
    none, or shares one with another module (a tied output embedding: its gradient holds the
    other use's too).
    """
    try:
        module = root.get_submodule(name)
    except AttributeError:
        return None
    if not isinstance(module, LINEAR_IN_PARAMETERS) and type(module).__name__ not in LINEAR_BY_NAME:
        return None
    params = list(module.parameters(recurse=False))
    uses: dict[int, int] = {}
    for _, param in root.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    if not params or any(uses.get(id(p), 0) != 1 for p in params):
        return None
    return params


def pull(params: list[Tensor]) -> Optional[Tensor]:
    """``sum(<p, dL/dp>)`` over ``params`` in float32, on their device (no sync); None where one has no dense gradient."""
    if any(p.grad is None or p.grad.is_sparse for p in params):
        return None
    with torch.no_grad():
        return torch.stack([(p.detach().float() * p.grad.float()).sum() for p in params]).sum()
