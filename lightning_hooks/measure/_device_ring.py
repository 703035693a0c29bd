"""The last rows of a stream kept on device: the spike windows' and the flight recorder's ring buffer."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["DeviceRing"]


class DeviceRing:
    """The last ``size`` rows of a stream, kept on device; writing a row is one copy, with no host sync.

    Args:
        size: How many rows it keeps.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.count = 0  # rows written so far (a host int: the position needs no sync)
        self.rows: Optional[Tensor] = None

    def push(self, row: Tensor) -> None:
        """Write ``row`` over the oldest; (re)made, full of NaN, when the row's length changes.

        The rows follow the row's device (once: rows restored from a checkpoint come from the CPU).
        """
        row = row.reshape(-1)
        if self.rows is None or self.rows.shape[1] != row.numel():
            self.rows = torch.full((self.size, row.numel()), math.nan, dtype=torch.float64, device=row.device)
            self.count = 0
        elif self.rows.device != row.device:
            self.rows = self.rows.to(row.device)
        self.rows[self.count % self.size] = row
        self.count += 1

    def ordered(self) -> Optional[Tensor]:
        """The rows held, oldest first (on device); None before the first."""
        if self.rows is None:
            return None
        held = min(self.count, self.size)
        start = self.count % self.size if self.count > self.size else 0
        return self.rows.roll(-start, 0)[:held]

    def state_dict(self) -> dict[str, Any]:
        """The rows (on the CPU) and the count."""
        return {"rows": None if self.rows is None else self.rows.cpu(), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the rows move to the values' device at the next push.

        Rows saved by a ring of another size (``window`` changed on resume): the last
        ``min(size, held)`` of them are kept, oldest first.
        """
        rows, self.count = state["rows"], int(state["count"])
        if rows is None or rows.shape[0] == self.size:
            self.rows = None if rows is None else rows.clone()
            return
        saved = DeviceRing(rows.shape[0])
        saved.rows, saved.count = rows, self.count
        kept = saved.ordered()[-self.size:]  # type: ignore[index]  # rows is not None
        self.rows = torch.full((self.size, rows.shape[1]), math.nan, dtype=rows.dtype)
        self.rows[: len(kept)] = kept
        self.count = len(kept)
