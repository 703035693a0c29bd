"""What the gradient check reads from one optimizer step's gradients, all of it on device.

:func:`measure_step` finds the parameters the optimizer holds dense gradients for, asks the
AMP grad scaler whether it skips the step, measures the gradients' norms (per gradient, per
parameter group and in total) once, and computes each reading callback's anomaly flags: a
:class:`Step` per callback, with nothing read back to the host. Asking the scaler may unscale
the gradients (a fused optimizer's), so it comes before anything else reads them. Agreeing on
it across ranks is :mod:`lightning_hooks.distributed._rank_agreement`'s job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from lightning_hooks.core._torch_internals import grad_scaler_state
from lightning_hooks.measure._sharding import ShardGroupCache, grad_of
from lightning_hooks.measure.anomalies import AnomalyDetector, GradientFigures, gradient_figures


def _params_with_grads(optimizer: Any) -> tuple[list[Tensor], list[Tensor], list[int]]:
    """The parameters of ``optimizer`` that have a dense gradient, those gradients, and how many per group.

    The gradients are :func:`~lightning_hooks.measure._sharding.grad_of`'s: an FSDP1 rank's empty part has an empty one.
    """
    params: list[Tensor] = []
    grads: list[Tensor] = []
    sizes: list[int] = []
    for group in optimizer.param_groups:
        start = len(params)
        group_params = group["params"]
        group_grads = [param.grad for param in group_params]
        if _all_dense(group_grads):  # the usual case: no call per parameter
            params.extend(group_params)
            grads.extend(group_grads)
        else:
            for param in group_params:
                grad = grad_of(param)
                if grad is not None and grad.layout == torch.strided:
                    params.append(param)
                    grads.append(grad)
        sizes.append(len(params) - start)
    return params, grads, sizes


_STRIDED = torch.strided


def _all_dense(grads: list[Optional[Tensor]]) -> bool:
    """Whether every one of ``grads`` is there and dense (a loop, not ``all`` over a generator: no frame each)."""
    for grad in grads:
        if grad is None or grad.layout is not _STRIDED:
            return False
    return True


def _amp_overflow(trainer: pl.Trainer, optimizer: Any, device: torch.device) -> Optional[Tensor]:
    """Whether the AMP grad scaler found an Inf or a NaN, and so skips this step; None without one.

    Lightning unscales before ``on_before_optimizer_step``, and ``GradScaler.unscale_`` leaves
    its finding in the optimizer's ``found_inf_per_device``. An optimizer that would unscale in
    its own ``step`` (``fused=True``) is unscaled here, as for gradient clipping, so that the
    figures are of the true gradients and a dropped update still leaves the scaler consistent.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    if grad_scaler_state(scaler, optimizer)["stage"] is OptState.READY:
        scaler.unscale_(optimizer)
    found = list(grad_scaler_state(scaler, optimizer)["found_inf_per_device"].values())
    return torch.stack([f.to(device) for f in found]).sum() > 0 if found else None


def _index(optimizers: Sequence[Any], optimizer: Any) -> int:
    """Where ``optimizer`` is in ``optimizers`` (by identity), 0 if it is not there; a loop, no generator frame."""
    for i, opt in enumerate(optimizers):
        if opt is optimizer:
            return i
    return 0


@dataclass
class Step:
    """One optimizer step's figures, still on device."""

    key: int
    params: list[Tensor]
    figures: GradientFigures
    flags: Optional[Tensor]
    """The detector's flags; None when they are made on the host from the norms (:func:`flags_on_host`)."""
    overflow: Optional[Tensor]
    unsure: Optional[Tensor]
    """How many gradients have an infinite norm but were not checked for NaN and Inf values (None with the flags)."""


def flags_on_host(trainer: pl.Trainer, detectors: Sequence[AnomalyDetector], figures: GradientFigures,
                  overflow: Optional[Tensor]) -> bool:
    """Whether the step's flags can be made on the host from its norms alone, with no tensor operation.

    So they can under one process, without a scaler that may skip the step, where every column is
    finite exactly when its norm is (:attr:`GradientFigures.finite`) and no detector compares with
    its running median (kept on device): the flags are then plain comparisons of a few numbers
    the step's one transfer brings anyway (:func:`~lightning_hooks.distributed._rank_agreement.host_flags`).
    """
    return (trainer.world_size == 1 and overflow is None and figures.by_norm
            and all(d.relative_threshold is None for d in detectors))


def measure_step(trainer: pl.Trainer, optimizer: Any, detectors: Sequence[AnomalyDetector],
                 shard_groups: ShardGroupCache, exact: bool) -> list[Step]:
    """Measure ``optimizer``'s gradients once and flag them with each of ``detectors``, on device.

    May unscale the gradients first (an optimizer that unscales in its own ``step``), so that
    the figures are of the true gradients; call it before anything else reads them.

    Args:
        trainer: The trainer, for the precision plugin's scaler, the optimizers and the device.
        optimizer: The optimizer about to step.
        detectors: The thresholds and running medians that give the flags, one per callback
            that reads the step.
        shard_groups: How the gradients are split across ranks.
        exact: Tell NaN and Inf gradients apart from finite ones whose norm overflows.

    Returns:
        Per detector, the step's figures (the same tensors for every detector) and its flags, on
        the gradients' device; no flags where they are made on the host (:func:`flags_on_host`).
    """
    params, grads, sizes = _params_with_grads(optimizer)
    device = params[0].device if params else trainer.strategy.root_device
    overflow = _amp_overflow(trainer, optimizer, device) if params else None  # may unscale (in place): first
    figures = gradient_figures(grads, sizes, device=device, exact=exact, shards=shard_groups(params))
    key = _index(trainer.optimizers, optimizer)
    if flags_on_host(trainer, detectors, figures, overflow):  # the flags follow from the norms, on the host
        return [Step(key, params, figures, None, None, None) for _ in detectors]
    unsure = torch.zeros((), device=device) if exact or figures.exact else torch.isinf(figures.measured).sum()
    shared: dict[Any, Tensor] = {}  # detectors that flag alike share one computation of the flags
    steps = []
    for detector in detectors:
        alike = detector.shares_flags
        flags = shared.get(alike) if alike is not None else None
        if flags is None:
            flags = detector.flags(figures, key)
            if overflow is not None:  # the scaler skips this step itself
                flags = flags & ~overflow
            if alike is not None:
                shared[alike] = flags
        steps.append(Step(key, params, figures, flags, overflow, unsure))
    return steps
