"""What every example silences, narrowly and by message: Lightning's own output that is not about the example.

- ``isinstance(treespec, LeafSpec)`` is deprecated: a FutureWarning torch raises inside
  Lightning's own pytree code (lightning 2.6 on torch 2.13), on every ``fit``; nothing the
  example or lightning_hooks does, and nothing a reader can act on.
- "💡 Tip: ... litlogger": an advertisement every Trainer prints.

Everything else Lightning says (devices, why training stopped) is left as it is.
"""

from __future__ import annotations

import logging
import warnings

#: The loggers Lightning's ``rank_zero_info`` writes to, under either package's name.
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "pytorch_lightning.utilities.rank_zero")


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def quiet_lightning() -> None:
    """Silence the two messages above, and nothing else."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    for name in _RANK_ZERO_LOGGERS:
        logging.getLogger(name).addFilter(_not_a_tip)
