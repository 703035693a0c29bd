"""The prediction layer's pull: ``sum(y * dL/dy)`` of the last module's output, from its own parameters' gradients.

``sum(y * dL/dy)`` is the loss's derivative in the scale of ``y`` (``dL/dc`` at ``c = 1`` for
``c * y``): below 0 the loss asks for a larger output, above 0 a smaller one. A prediction layer
that grows because training pushes it (a slow optimizer fitting the targets' scale) has it below 0;
a fault that makes it overshoot has it above 0 while it grows on (docs/verdicts.md). For a module
whose output is linear in its own parameters (``y = W x + b``: a Linear, a convolution, an
embedding, a norm's affine) it is ``sum(<p, dL/dp>)`` over them, read from the gradients the step
has anyway: no activation hook, two small reductions on a logged step, brought to the host in the
ActivationMonitor's own transfer.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import Tensor, nn

from lightning_hooks.callbacks._steps import log_step
from lightning_hooks.callbacks.activations import ActivationMonitor
from lightning_hooks.output.figures import ScalarBlock

#: Modules whose output is linear in their own parameters (weight and bias) taken together.
LINEAR_IN_PARAMETERS = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.Embedding, nn.LayerNorm, nn.GroupNorm,
                        nn.modules.batchnorm._NormBase)
#: The same, by class name, where the class is not importable here (``transformers``' GPT-2 ``Conv1D``).
LINEAR_BY_NAME = ("Conv1D",)


def own_parameters(root: nn.Module, name: str) -> Optional[list[Tensor]]:
    """The parameters of ``root``'s module ``name`` (not its children's), where ``sum(<p, dL/dp>)`` is its pull.

    None where the module is not linear in its own parameters (:data:`LINEAR_IN_PARAMETERS`), has
    none, shares one with another module (a tied output embedding: its gradient holds the other
    use's too), or is not the last module of ``root`` that holds parameters: the last module an
    ActivationMonitor watches is the prediction layer only where it watches the model to its end.
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
    holders = [n for n, m in root.named_modules() if next(m.parameters(recurse=False), None) is not None]
    if not params or any(uses.get(id(p), 0) != 1 for p in params) or holders[-1] != name:
        return None
    return params


def pull(params: list[Tensor]) -> Optional[Tensor]:
    """``sum(<p, dL/dp>)`` over ``params`` in float32, on their device (no sync); None without a dense gradient."""
    if any(p.grad is None or p.grad.is_sparse for p in params):
        return None
    with torch.no_grad():  # a dot product: no temporary the size of the parameter (in float32)
        return torch.stack([torch.dot(p.detach().reshape(-1).float(), p.grad.reshape(-1).float())
                            for p in params]).sum()


def whole_parameters(strategy: Any) -> bool:
    """Whether ``strategy`` holds every parameter whole on each rank: one device, or DDP (not DeepSpeed or XLA).

    DeepSpeed's and XLA's strategies are DDP's subclasses, but ZeRO-3 partitions the parameters.
    """
    kinds = {kind.__name__ for kind in type(strategy).__mro__}
    partitioned = {"DeepSpeedStrategy", "XLAStrategy"}
    return isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and not kinds & partitioned


class PredictionPull:
    """LayerHealth's measure of the prediction layer's pull: taken before the optimizer step, sent with the monitor's.

    On a step the ActivationMonitor collects (:meth:`~lightning_hooks.ActivationMonitor.collects`:
    its logged steps, and those it watches closely after an anomaly), on rank zero: taken in
    ``on_before_optimizer_step`` (the parameters that made the output, and their gradients: after
    accumulation and AMP's unscaling) and handed, on device, to the monitor
    (:meth:`~lightning_hooks.ActivationMonitor.carry`), which brings it to the host in the step's
    one transfer and logs it with the step's figures as ``activation_grads/<module>/pull``,
    which LayerHealth and the Layers tab judge: no host read of its own. Not taken under a
    sharded strategy (a shard's parameters give a part of the sum).
    """

    def __init__(self) -> None:
        self.row: Optional[str] = None  # the prediction layer: the last module in forward order
        self.params: dict[str, Optional[list[Tensor]]] = {}  # by module: its own parameters, None where no pull
        self.taken: Optional[int] = None  # the last step whose pull the monitor carries (one per step)
        self.monitor: Optional[ActivationMonitor] = None  # whose collected steps take the pull (None: no step)

    def start(self, trainer: pl.Trainer, monitor: Optional[ActivationMonitor]) -> None:
        """Take the pull on the steps ``monitor`` collects (None: never), where parameters are whole.

        ``monitor``: the ActivationMonitor whose figures are judged: the steps it collects include
        those it watches closely after an anomaly (``watch_after``), where the judge needs the pull too.
        """
        self.row, self.params, self.taken = None, {}, None
        self.monitor = monitor if whole_parameters(trainer.strategy) else None

    def stop(self) -> None:
        """Let go of the parameters and the monitor (at the end of fit, or when it raises)."""
        self.row, self.params, self.taken, self.monitor = None, {}, None, None

    def take(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """In ``on_before_optimizer_step``: a collected step's pull, handed on device to the monitor."""
        step, name, monitor = log_step(trainer), self.row, self.monitor
        if (name is None or monitor is None or not trainer.is_global_zero or self.taken == step
                or not monitor.collects(step)):
            return
        if name not in self.params:
            self.params[name] = own_parameters(pl_module, name)
        params = self.params[name]
        value = pull(params) if params else None
        figure = ScalarBlock("activation_grads", "pull", [name], [], [f"activation_grads/{name}/pull"])
        if value is not None and monitor.carry(step, value.reshape(1), figure):
            self.taken = step
