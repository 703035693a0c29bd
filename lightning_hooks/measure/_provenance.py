"""NaN provenance: where in a step non-finite values showed first, traced by hooks without host syncs."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_hooks.measure._sharding import local
from lightning_hooks.measure._tensor_values import iter_tensors

#: The position :class:`NonFiniteTrace` gives a hook that saw nothing non-finite.
NEVER = torch.iinfo(torch.int64).max


class Located(NamedTuple):
    """Where non-finite values showed first in a step, as :meth:`NonFiniteTrace.locate` finds it."""

    rank: Optional[int]
    """The rank this is about (None under one process): the first whose module outputs went
    non-finite, else the first whose gradients did."""
    first: list[int]
    """Per hook index, the position in that rank's step of its first non-finite call (``NEVER``: none)."""
    micro_batch: Optional[int]
    """The micro-batch of the step (from 0) that holds that rank's first non-finite call; None if none."""

    def earliest(self, indices: range) -> Optional[int]:
        """Of ``indices``, the one that went non-finite first; None if none did."""
        best = min(indices, key=self.first.__getitem__, default=None)
        return best if best is not None and self.first[best] < NEVER else None


class NonFiniteTrace:
    """Where non-finite values began in a step: module outputs in forward order, gradients in backward order.

    Its hooks append ``(index, on-device witness)`` per tensor, in call order, and never sync
    with the host: a forward hook for each floating tensor a module outputs, a
    post-accumulate-grad hook for a parameter's gradient as backward accumulates it (it runs at
    every step, as a step is known to be bad only at its end). The witness is the tensor's
    smallest and largest value, non-finite exactly when the tensor holds a NaN or an Inf: one
    reduction, about ten times cheaper on CPU than ``isfinite().all()`` (which writes a mask as
    large as the tensor) or an infinity norm. :meth:`mark`
    notes where each micro-batch starts. :meth:`locate` reads the calls (one all-gather across
    ranks, one transfer) only for a reported step; :meth:`clear` drops them once per step, so
    no tensor outlives its step.
    """

    def __init__(self) -> None:
        self._calls: list[tuple[int, Tensor]] = []
        self._marks: list[int] = []

    def output_hook(self, index: int) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        """Return a forward hook recording whether module ``index``'s outputs are all finite."""

        @torch.no_grad()
        def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            for tensor in iter_tensors(output):
                if _is_float(tensor):
                    self._calls.append((index, _extremes(tensor)))

        return record

    def grad_hook(self, index: int) -> Callable[[Tensor], None]:
        """Return a post-accumulate-grad hook recording whether a parameter's gradient is all finite."""

        @torch.no_grad()
        def record(param: Tensor) -> None:
            grad = None if param.grad is None else local(param.grad)  # a DTensor: this rank's shard
            if grad is not None and _is_float(grad):
                self._calls.append((index, _extremes(grad)))

        return record

    def mark(self) -> None:
        """Start a micro-batch: the calls from here on belong to it."""
        self._marks.append(len(self._calls))

    def clear(self) -> None:
        """Drop the recorded calls and micro-batch marks."""
        self._calls.clear()
        self._marks.clear()

    def first_nonfinite(self, size: int, device: torch.device) -> Tensor:
        """(size,) int64 on ``device``: per index, the position of its first non-finite call, or ``NEVER``."""
        first = torch.full((size,), NEVER, dtype=torch.int64, device=device)
        if self._calls:
            finite = torch.stack([v.isfinite().all().to(device) for _, v in self._calls])
            index = torch.tensor([i for i, _ in self._calls], device=device)
            position = torch.arange(len(self._calls), device=device)
            first.scatter_reduce_(0, index, torch.where(finite, NEVER, position), "amin")
        return first

    def locate(self, trainer: pl.Trainer, n_outputs: int, size: int) -> Located:
        """Where non-finite values showed first, over every rank; every rank must call it.

        Indices below ``n_outputs`` are module outputs, the rest up to ``size`` gradients.
        """
        device = trainer.strategy.root_device
        marks = torch.tensor(self._marks, dtype=torch.int64, device=device)
        local = torch.cat([self.first_nonfinite(size, device), marks])
        if trainer.world_size > 1:
            local = trainer.strategy.all_gather(local)
        rows = local.reshape(trainer.world_size, -1).cpu().tolist()
        seen = [[min(row[:n], default=NEVER) < NEVER for n in (n_outputs, size)] for row in rows]
        rank = next((r for r, (outputs, _) in enumerate(seen) if outputs), None)
        rank = next((r for r, (_, any_call) in enumerate(seen) if any_call), None) if rank is None else rank
        if rank is None:
            return Located(None, [NEVER] * size, None)
        first, marks_of_rank = rows[rank][:size], rows[rank][size:]
        position = min(first)
        micro = max((k for k, mark in enumerate(marks_of_rank) if mark <= position), default=None)
        return Located(rank if trainer.world_size > 1 else None, first, micro)


def _is_float(tensor: Tensor) -> bool:
    """Whether ``tensor`` can hold a NaN or an Inf and has values to check."""
    return tensor.layout == torch.strided and not tensor.is_meta and tensor.numel() > 0 and (
        tensor.is_floating_point() or tensor.is_complex()
    )


def _extremes(tensor: Tensor) -> Tensor:
    """The smallest and largest value of a non-empty floating ``tensor``: finite exactly when it all is.

    ``aminmax`` propagates NaN, and an Inf is an extreme. A complex tensor is checked through its
    real and imaginary parts.
    """
    values = torch.view_as_real(tensor.resolve_conj()) if tensor.is_complex() else tensor
    return torch.stack(torch.aminmax(values))
