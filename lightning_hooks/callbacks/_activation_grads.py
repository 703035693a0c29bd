"""ActivationMonitor's gradients: ``dL/d(output)`` of each selected module, through tensor hooks on its outputs.

A module's forward hook (on a logged training step, not in a recomputation by gradient
checkpointing) puts a tensor hook on each output tensor that requires grad; the hook adds the
gradient reaching that tensor to the module's gradient row of the step's :class:`StatBlock`, on
the device. Tensor hooks, not ``register_full_backward_hook``: they work through in-place ops on
the output (``ReLU(inplace=True)``, ``x += shortcut``: a hook registered before the in-place op
sees the gradient of the value the module returned), with outputs in tuples, dicts and
dataclasses, and with modules that return their input as is.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor

from lightning_hooks.measure._tensor_values import iter_tensors
from lightning_hooks.measure.aggregate import StatBlock

#: The prefix of the gradient figures' tags: ``activation_grads/<module>/<stat>``.
GRAD_PREFIX = "activation_grads"


def watch_output_gradients(output: Any, block: StatBlock, row: int) -> None:
    """Put a tensor hook on each tensor of ``output`` that requires grad, adding its gradient to ``block``'s ``row``.

    The call counts once: with whichever of its tensors gets a gradient first (one that gets none,
    as an unused entry of a dict or an LSTM's ``c_n``, does not take the count with it).
    """
    pending = [True]  # shared by the call's hooks: the first to fire takes the count
    for tensor in iter_tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(_recorder(block, row, pending))


def _recorder(block: StatBlock, row: int, pending: list[bool]) -> Callable[[Tensor], None]:
    def record(grad: Tensor) -> None:
        if block.add(row, grad.detach(), int(pending[0])):
            pending[0] = False

    return record
