"""How the ranks agree on a checked step, and the step's one host transfer.

:func:`conclude` sums every rank's flags and votes (the scaler skipped the step, a rank had no
gradient, a norm was infinite) in one collective on device, then brings them to the host in
one transfer together with the norms and whatever figures the callback adds: a
:class:`Check`, the same on every rank, so that no rank decides alone and no rank waits alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_hooks._step_measure import Step
from lightning_hooks.anomalies import FLAG_NAMES, AnomalyDetector


def _agree(trainer: pl.Trainer, votes: Tensor) -> Tensor:
    """Sum ``votes`` over ranks, on device: no collective under one process, and no host sync."""
    if trainer.world_size == 1:
        return votes
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(votes)  # not strategy.reduce, whose barrier blocks the host
        return votes
    return trainer.strategy.reduce(votes, reduce_op="sum")


@dataclass
class Check:
    """One optimizer step's figures, on the host; flags and the rest agreed across ranks."""

    flags: dict[str, bool]
    amp_overflow: Optional[bool]
    norms: list[float]
    anomalous: bool
    extra: list[float]
    skipped: bool
    """The scaler skipped the step, or a rank had no gradient: it says nothing about the gradients."""
    unsure: bool
    """A rank had an infinite norm that a finite gradient may have: measure exactly, agree again."""


def conclude(trainer: pl.Trainer, detector: AnomalyDetector, step: Step, extra: list[Tensor],
             remember: bool = True) -> Check:
    """Agree on the flags across ranks on device, then read everything in one transfer.

    Every rank reaches the one collective at every optimizer step, a rank without
    gradients too, so a decision one rank alone made is everyone's and no rank waits alone.
    A clean, settled step's norms join ``detector``'s running median (with ``remember``).

    Args:
        trainer: The trainer, for the world size and the strategy.
        detector: The thresholds that gave ``step``'s flags, and the running medians.
        step: The step's figures, as :func:`~lightning_hooks._step_measure.measure_step` gives them.
        extra: More device figures to bring to the host in the same transfer.
        remember: Whether a clean step's norms join the running median: not for a closure's
            later evaluations within one optimizer step (LBFGS), so that the median counts steps.

    Returns:
        The step's figures on the host, agreed across ranks.
    """
    norms = step.figures.group_norms
    overflow = step.overflow if step.overflow is not None else torch.zeros((), device=norms.device)
    empty = torch.full((), float(not step.params), device=norms.device)
    votes = torch.cat([t.reshape(-1).double() for t in (step.flags, overflow, empty, step.unsure)])
    parts = [_agree(trainer, votes), norms, *extra]
    host = torch.cat([p.reshape(-1).to(norms.device, torch.float64) for p in parts]).cpu().tolist()
    n_flags, n_cols = step.flags.numel(), norms.numel()
    # All gradients first, as "<flag>"; then per group, as "<flag>/group<i>", if several.
    columns = [(n_cols - 1, "")] + ([(g, f"/group{g}") for g in range(n_cols - 1)] if n_cols > 2 else [])
    flags = {
        name + suffix: host[row * n_cols + col] > 0
        for row, name in enumerate(FLAG_NAMES) if name in detector.enabled_flags
        for col, suffix in columns
    }
    overflowed, skipped = host[n_flags] > 0, host[n_flags] > 0 or host[n_flags + 1] > 0
    # Settled without an exact measure when no flag could hinge on it, or the scaler skips the step.
    unsure = host[n_flags + 2] > 0 and bool(detector.enabled_flags) and not overflowed
    anomalous = any(flags.values())
    if remember and not anomalous and not skipped and not unsure:
        detector.remember(norms, step.key)
    amp = overflowed if step.overflow is not None else None
    start = n_flags + 3
    return Check(flags, amp, host[start : start + n_cols], anomalous, host[start + n_cols :], skipped, unsure)
