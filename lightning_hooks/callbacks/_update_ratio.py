"""The update-to-weight ratio ``||Δw|| / ||w||`` of one optimizer step, per row of parameters."""

from __future__ import annotations

import math
import operator
from itertools import repeat
from typing import Any, NamedTuple, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_hooks.callbacks._base import log_step
from lightning_hooks.callbacks._gradient_rows import Row, Rows
from lightning_hooks.callbacks._step_copies import step_copies
from lightning_hooks.measure._sharding import ShardGroupCache, ShardGroups, grad_of, local
from lightning_hooks.output.figures import ScalarBlock
from lightning_hooks.output.sinks import log_scalars


class UpdateRatio:
    """A snapshot of some parameters just before an optimizer step, and their update ratio after it.

    :meth:`take` holds the parameters in the optimizer's
    :class:`~lightning_hooks.callbacks._step_copies.StepCopies` (only on the steps asked for,
    so other steps cost nothing and hold no copy; a parameter UpdateTransform copies for the same
    step is not copied again); :meth:`finish`, run once the optimizer has stepped,
    measures ``||w_after - w_before|| / ||w_before||`` per row (``||w_before||`` summed as the copy
    was made, in the same read on the CPU; the update's norm in one pass over both), brings
    the figures to the host in one transfer, and drops the snapshot. A row whose parameters
    lost their gradients before the step (an update dropped by ``GradientAnomalyStopping``)
    gives no ratio, nor does a row whose parameters were all zeros before the step (a bias or a
    LayerNorm shift at initialisation: ``||w_before|| = 0``, the ratio is undefined), and a step
    that never ran (a GradScaler skipping it) never finishes:
    :meth:`discard` drops its snapshot. Between consecutive measured steps the copy's memory is
    kept and copied into (``discard(keep=True)``); at a batch whose next step is not measured it is
    freed.

    When the next step is measured too (``take(..., next_measured=True)``) and this reader is the
    copies' last, on the CPU the update's norm is taken in the pass that also writes ``w_after``
    into the copy (summing its squares): the next step holds that copy as it is when no parameter
    changed in between (see :meth:`StepCopies.update_squares
    <lightning_hooks.callbacks._step_copies.StepCopies.update_squares>`), three passes a step instead of
    four, with the same figures. The rows' names and tags are made once per list of rows, and a
    step where every parameter has its gradient and every row a ratio checks that in C-level list
    operations: many small parameters cost little more than their copy and norm.
    """

    def __init__(self, norms: bool = False) -> None:
        self.norms = norms  # also the update's norm and, where the optimizer keeps them, Adam's moments' norms
        self._rows: Rows = []
        self._flat: list[Tensor] = []  # the rows' parameters, one after another
        self._every = False  # every row of the rows given is held, each parameter with a gradient
        self._layout: Optional[_Layout] = None  # the last rows' names and tags, made once
        self._next_measured = False  # the step after this one is measured too: chain its copy
        self._optimizer: Any = None  # the optimizer whose snapshot holds this step's parameters
        self._kept: dict[int, Any] = {}  # by id: the optimizers asked to keep their copies' memory for the next step
        self._shard_groups = ShardGroupCache()  # how the rows' parameters are split across ranks

    @property
    def pending(self) -> bool:
        """Whether a snapshot is held (between :meth:`take` and :meth:`finish` or :meth:`discard`)."""
        return self._optimizer is not None and step_copies(self._optimizer).holds(self)

    def take(self, rows: Rows, optimizer: Any, next_measured: bool = False) -> None:
        """Hold ``rows``' parameters (those with a gradient) in ``optimizer``'s snapshot before it steps.

        Args:
            rows: The rows to measure.
            optimizer: The optimizer about to step.
            next_measured: The next step is measured too: :meth:`finish` may leave the parameters
                as they are after this step in the copy (in the pass that measures the update),
                for that step to hold without a copy.
        """
        self.discard(keep=True)
        self._next_measured = next_measured
        flat = [p for _, params in rows for p in params]
        layout = self._layout
        if layout is None or layout.keys != list(map(id, flat)):
            layout = self._layout = _Layout.of(rows, flat)
        if layout.every_row and _all_present([p.grad for p in flat]):  # the common case: no check per parameter
            self._rows, self._flat, self._every = rows, flat, True
        else:
            stepped = [Row(name, [p for p in params if grad_of(p) is not None]) for name, params in rows]
            self._rows, self._every = [row for row in stepped if row.params], False
            self._flat = [p for _, params in self._rows for p in params]
        if not self._rows:
            return
        step_copies(optimizer).hold(self, self._flat, squares=True)
        self._optimizer = optimizer

    def register(self, trainer: pl.Trainer) -> list[RemovableHandle]:
        """Put a step post-hook on each of ``trainer``'s optimizers that finishes the measure and logs it."""

        def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            log_scalars(trainer, {}, log_step(trainer), self.finish(optimizer, trainer.is_global_zero))

        return [optimizer.register_step_post_hook(hook) for optimizer in trainer.optimizers]

    def discard(self, keep: bool = False) -> None:
        """Let go of the snapshot and the references to the parameters.

        Args:
            keep: The next step is measured too: its copies' memory may be kept to copy into
                (else it is freed, unless another reader keeps it for its next step).
        """
        if self._optimizer is not None:
            self._kept[id(self._optimizer)] = self._optimizer
        for optimizer in self._kept.values():
            step_copies(optimizer).release(self, keep)
        if not keep:
            self._kept.clear()
        self._rows, self._flat, self._optimizer = [], [], None

    def forget(self) -> None:
        """Drop the snapshot and what was learnt of the parameters' layout (at the end of a fit)."""
        self.discard()
        self._shard_groups.clear()
        self._layout = None

    def finish(self, optimizer: Any, to_host: bool) -> list[ScalarBlock]:
        """The rows' ``updates/<row>/ratio`` and ``log10_ratio`` after ``optimizer``'s step; none for another one.

        Args:
            optimizer: The optimizer that just stepped.
            to_host: Whether to measure and bring the figures to the host (rank zero), or only
                drop the snapshot.
        """
        if not self.pending or optimizer is not self._optimizer:
            return []
        shared, rows, flat, every = step_copies(optimizer), self._rows, self._flat, self._every
        before, weights, alone = shared.copies(self), shared.squares(self), shared.exclusive(self)
        self.discard(keep=True)  # the memory is freed at the batch's end unless the next step is measured
        shards = self._shard_groups(flat)
        if not to_host and not shards.sharded:
            return []
        moments = _moment_squares(optimizer, rows) if self.norms else None
        grads = [p.grad for p in flat]  # before the pass: it would evict the parameters from the cache
        deltas = shared.update_squares(flat, before, alone, self._next_measured)
        squares = _row_squares(rows, deltas, weights, shards, moments)  # sharded: every rank sums
        if not to_host:
            return []
        deltas, weights, *moment_sums = squares.cpu().tolist()  # the one transfer
        layout = self._layout
        if every and layout is not None and _all_present(grads) and all(w > 0 for w in weights):
            names, ratios = layout.names, list(map(math.sqrt, map(operator.truediv, deltas, weights)))
            tags = layout.tags
        else:
            names, ratios = _ratios(rows, deltas, weights, grads)
            tags = _tags(names)
        logs = [math.log10(ratio) if ratio > 0 else -math.inf for ratio in ratios]
        blocks = [ScalarBlock("updates", "ratio", names, ratios, tags[0]),
                  ScalarBlock("updates", "log10_ratio", names, logs, tags[1])]
        if self.norms and any(g is not None for g in grads):
            blocks += _norm_blocks(rows, deltas, moment_sums, optimizer)
        return blocks


class _Layout(NamedTuple):
    """What one list of rows logs under, worked out once: its parameters' ids, its names and tags."""

    keys: list[int]
    every_row: bool  # no row is empty
    names: list[str]
    tags: tuple[list[str], list[str]]  # ratio, log10_ratio

    @staticmethod
    def of(rows: Rows, flat: list[Tensor]) -> _Layout:
        """The layout of ``rows``, whose parameters one after another are ``flat``."""
        names = [name for name, _ in rows]
        return _Layout(list(map(id, flat)), all(params for _, params in rows), names, _tags(names))


def _tags(names: list[str]) -> tuple[list[str], list[str]]:
    """The rows' ``updates/<row>/ratio`` and ``updates/<row>/log10_ratio`` tags."""
    return [f"updates/{n}/ratio" for n in names], [f"updates/{n}/log10_ratio" for n in names]


def _all_present(grads: list[Optional[Tensor]]) -> bool:
    """Whether no gradient is None (compared in C: a Python loop per parameter costs more than the check)."""
    return all(map(operator.is_not, grads, repeat(None)))


def _updated(params: list[Tensor]) -> bool:
    """Whether every parameter of a row was updated: each has a gradient (an empty one, on this rank, may not)."""
    return all(p.grad is not None or p.numel() == 0 for p in params)


def _ratios(rows: Rows, deltas: list[float], weights: list[float],
            grads: list[Optional[Tensor]]) -> tuple[list[str], list[float]]:
    """The rows with a ratio, and their ratios: those whose update was made, and weights not all zero before it."""
    # A dropped update leaves no gradient at all; FSDP1 leaves none where this rank's part is empty.
    kept = any(g is not None for g in grads)
    names, ratios = [], []
    for (name, params), delta, weight in zip(rows, deltas, weights):
        # All zeros before the step (a bias at initialisation): no ratio is defined (it would be inf).
        if weight > 0 and kept and _updated(params):
            names.append(name)
            ratios.append(math.sqrt(delta / weight))
    return names, ratios


def _norm_blocks(rows: Rows, deltas: list[float], moments: list[list[float]], optimizer: Any) -> list[ScalarBlock]:
    """``updates/<row>/norm``; with Adam's moments, ``exp_avg_norm`` and ``exp_avg_sq_sqrt_norm`` (``||sqrt(v)||``)."""
    present = [i for i, (_, params) in enumerate(rows) if _updated(params)]
    names = [rows[i].name for i in present]
    blocks = [ScalarBlock("updates", "norm", names, [math.sqrt(deltas[i]) for i in present],
                          [f"updates/{n}/norm" for n in names])]
    if moments:
        with_state = [i for i in present if all(_moments(optimizer, p) is not None for p in rows[i].params)]
        names = [rows[i].name for i in with_state]
        for stat, sums in (("exp_avg_norm", moments[0]), ("exp_avg_sq_sqrt_norm", moments[1])):
            blocks.append(ScalarBlock("updates", stat, names, [math.sqrt(sums[i]) for i in with_state],
                                      [f"updates/{n}/{stat}" for n in names]))
    return blocks


def _moments(optimizer: Any, param: Tensor) -> Optional[tuple[Tensor, Tensor]]:
    state = optimizer.state.get(param, {})
    if "exp_avg" in state and "exp_avg_sq" in state:
        return local(state["exp_avg"]), local(state["exp_avg_sq"])
    return None


def _moment_squares(optimizer: Any, rows: Rows) -> Optional[Tensor]:
    """Per parameter, ``||m||²`` and ``||sqrt(v)||² = sum(v)`` of Adam's moments (no copy of ``v``): ``(2, params)``.

    None when no parameter has them (not an Adam-family optimizer); zeros where one has none.
    """
    found = [_moments(optimizer, p) for _, params in rows for p in params]
    if not any(found):
        return None
    with torch.no_grad():
        where = [i for i, m in enumerate(found) if m is not None]
        firsts = torch.stack(torch._foreach_norm([found[i][0] for i in where], 2, dtype=torch.float32))  # type: ignore[index]
        seconds = torch.stack([found[i][1].sum(dtype=torch.float32) for i in where])  # type: ignore[index]
        squares = torch.zeros(2, len(found), dtype=torch.float64, device=firsts.device)
        index = torch.tensor(where, device=firsts.device)
        squares[:, index] = torch.stack([firsts.double().square(), seconds.double()])
        return squares


def _row_squares(rows: Rows, deltas: Tensor, weights: Tensor, shards: ShardGroups,
                 moments: Optional[Tensor] = None) -> Tensor:
    """Per row, the squared norms of the update and of the weights before it: a ``(2, rows)`` tensor.

    ``deltas`` and ``weights``: each parameter's ``||w_after - w_before||²`` (one pass over both;
    on the CPU the update is never stored, see ``measure/_update_passes.py``) and ``||w_before||²``
    (summed as it was copied). With ``moments`` (``(2, params)``: Adam's ``||m||²`` and ``sum(v)``
    per parameter), two rows more. The rows' parameters lie one after another, so each row is a
    slice (views, no index goes to the device). Sharded parameters' squares are summed over their
    shards first, in one collective.
    """
    squares = torch.stack([deltas, weights.to(deltas.device)])
    if moments is not None:
        squares = torch.cat([squares, moments.to(deltas.device)])
    if shards.sharded:
        squares = shards.sum_(squares.T.contiguous()).T
    if len(rows) == squares.shape[1]:  # a parameter a row (the default): nothing to add up
        return squares
    bounds, start = [], 0
    for _, params in rows:
        bounds.append((start, start + len(params)))
        start += len(params)
    return torch.stack([squares[:, lo:hi].sum(1) for lo, hi in bounds], dim=1)
