"""Per-step stat buffers on device, reduced across ranks and moved to the host once per step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from lightning_hooks.measure._native import DirectKernel
from lightning_hooks.measure._stat_rows import SUM_FIELDS, new_rows, reduce_rows, reset_rows_
from lightning_hooks.measure._tensor_values import as_float_values, iter_tensors
from lightning_hooks.measure.stats import Binning, Bins, accumulate_, binning

_CALLS = SUM_FIELDS.index("calls")


class StatBlock:
    """One stat row per name, filled on device by hooks and drained once per logged step.

    Rows add across tensors, calls and micro-batches until :meth:`drain`, which reduces them
    across ranks with a single ``all_gather`` (sums add, extremes take the max), moves them to
    the host in one transfer, and resets the block.

    Args:
        names: One name per row (e.g. the selected modules).
        bins: Histogram bins, see :func:`lightning_hooks.measure.stats.histogram_edges`.
        device: Where the rows live (the LightningModule's device).
    """

    def __init__(self, names: list[str], bins: Bins, device: torch.device | str) -> None:
        self.names = names
        self.bins = bins
        host = binning(bins)
        self.edges = host.edge_list
        """The bin edges, shared with every block that bins with the same ``bins`` (see :func:`binning`)."""
        self.rows = new_rows(len(names), host.n_bins, device)
        self._binnings: dict[tuple[torch.device, torch.dtype], Binning] = {}
        # Filled for the rows' device up front: under torch.compile a first miss costs a recompile.
        native = self._binning(self.rows.device, torch.float32).native
        # Eager float32 tensors on the CPU: the C kernel straight into the rows, without the dispatcher.
        self._direct = DirectKernel(self.rows, *native) if native is not None and self.rows.is_cpu else None
        self.pending = False
        self._counted: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}  # for count: indices -> (index, ones)

    def _binning(self, device: torch.device, dtype: torch.dtype) -> Binning:
        """The histogram bins for values of ``dtype`` on ``device``."""
        found = self._binnings.get((device, dtype))
        if found is None:
            found = self._binnings[(device, dtype)] = binning(self.bins, device, dtype)
        return found

    def add(self, index: int, tensor: Tensor, calls: int = 1) -> bool:
        """Add one tensor's statistics, and ``calls`` calls, to row ``index``.

        Returns whether the tensor was added: tensors we cannot summarise are skipped.
        """
        if self._direct is not None and DirectKernel.takes(tensor):  # the usual case, in about 1.5 us
            self._direct.accumulate_(index, tensor, calls)
            self.pending = True
            return True
        values = as_float_values(tensor)
        if values is None:
            return False
        accumulate_(self.rows[index], values, self._binning(values.device, values.dtype), calls)
        self.pending = True
        return True

    def add_many(self, indices: list[int], tensors: list[Tensor], calls: list[int]) -> list[bool]:
        """:meth:`add` each of ``tensors`` to its row of ``indices`` with its ``calls``, in order.

        What holds for them all (eager code, no torch mode) is checked once, not per tensor: a
        step's gradients, two per module, cost about a microsecond less each.

        Returns:
            Per tensor, whether it was added.
        """
        direct = self._direct if self._direct is not None and DirectKernel.eager() else None
        added = []
        for index, tensor, call in zip(indices, tensors, calls):
            if direct is not None and DirectKernel.readable(tensor):
                direct.accumulate_(index, tensor, call)
                self.pending = True
                added.append(True)
            else:
                added.append(self.add(index, tensor, call))
        return added

    def count(self, indices: list[int]) -> None:
        """Add a call and no values to each row in ``indices`` (a rank's empty parts of split gradients).

        One kernel; the index goes to the device once for each list (the lists repeat, step by step).
        """
        key = tuple(indices)
        found = self._counted.get(key)
        if found is None:
            index = torch.tensor(key, device=self.rows.device)
            one_call = torch.zeros(len(key), self.rows.shape[1], dtype=self.rows.dtype, device=self.rows.device)
            one_call[:, _CALLS] = 1
            found = self._counted[key] = (index, one_call)
        self.rows.index_add_(0, *found)

    def add_all(self, index: int, value: Any) -> None:
        """Add every tensor inside ``value`` (one module call's output) to row ``index``.

        The call counts once, however many tensors the output holds.
        """
        if type(value) is Tensor:  # the usual output: no generator to walk it
            self.add(index, value)
            return
        calls = 1
        for tensor in iter_tensors(value):
            if self.add(index, tensor, calls):
                calls = 0

    def drain(self, trainer: pl.Trainer | Any) -> np.ndarray:
        """Reduce across ranks, copy to the host once (a float64 array, one row per name), reset.

        Every rank must call this together.
        """
        return self.drain_with(trainer, ())[0]

    def drain_with(self, trainer: pl.Trainer | Any, riders: Sequence[Tensor]) -> tuple[np.ndarray, list[float]]:
        """:meth:`drain`, bringing ``riders`` (this rank's own values, not reduced) to the host in the same copy.

        Every rank must call this together; ``riders`` may differ between ranks (rank zero's alone).

        Args:
            trainer: The trainer, for the ranks.
            riders: Tensors on any device, each brought over whole (flattened, as float64: exact
                for float32 and smaller), so that another callback's figures of the step cost no
                host read of their own.

        Returns:
            The rows (as :meth:`drain`), and the riders' values in order, flattened.
        """
        rows = self.rows
        if trainer.world_size > 1:
            rows = reduce_rows(trainer.strategy.all_gather(rows))
        if not riders:
            host = rows.cpu().numpy().copy()  # a copy: the reset below writes into a CPU block's memory
            self.reset()
            return host, []
        flat = [rows.reshape(-1), *(r.detach().reshape(-1).to(rows.device, rows.dtype) for r in riders)]
        joined = torch.cat(flat).cpu().numpy()  # a new tensor: the reset below cannot write into it
        self.reset()
        return joined[: rows.numel()].reshape(rows.shape), joined[rows.numel():].tolist()

    def reset(self) -> None:
        """Empty every row, on device, without reading it."""
        reset_rows_(self.rows)
        self.pending = False
