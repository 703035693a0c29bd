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

from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_hooks.measure._tensor_values import iter_tensors
from lightning_hooks.measure.aggregate import StatBlock

#: The prefix of the gradient figures' tags: ``activation_grads/<module>/<stat>``.
GRAD_PREFIX = "activation_grads"


def watch_output_gradients(output: Any, block: StatBlock, row: int, scale: list[Optional[Tensor]]) -> None:
    """Put a tensor hook on each tensor of ``output`` that requires grad, adding its gradient to ``block``'s ``row``.

    The call counts once: with whichever of its tensors gets a gradient first (one that gets none,
    as an unused entry of a dict or an LSTM's ``c_n``, does not take the count with it).
    ``scale`` holds what multiplies each gradient when its hook fires: None, or AMP's
    ``1 / loss_scale`` as a 0-dim tensor (set before the backward, read without a sync).
    """
    pending = [True]  # shared by the call's hooks: the first to fire takes the count
    for tensor in iter_tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(_recorder(block, row, pending, scale))


def _recorder(
    block: StatBlock, row: int, pending: list[bool], scale: list[Optional[Tensor]]
) -> Callable[[Tensor], None]:
    def record(grad: Tensor) -> None:
        factor = scale[0]
        # In float32: a float16 gradient times 1 / loss_scale could underflow.
        value = grad.detach() if factor is None else grad.detach().float() * factor
        if block.add(row, value, int(pending[0])):
            pending[0] = False

    return record


def inverse_loss_scale(trainer: pl.Trainer, device: torch.device) -> Optional[Tensor]:
    """``1 / loss_scale`` of the Trainer's AMP grad scaler as a 0-dim float32 tensor on ``device``; None without one.

    Read through ``scaler.scale`` (which starts a lazy scaler as the loss's scaling will), with no sync.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler.scale(torch.ones((), device=device)).reciprocal()
