"""Where an AnomalyReport finds the diagnosis so far: the first callback that diagnoses and has judged a step."""

from __future__ import annotations

from typing import Any, Optional


def diagnosis_so_far(trainer: Any) -> Optional[str]:
    """The diagnosis of the first callback in ``trainer.callbacks`` that has one to give.

    A callback diagnoses when it has a ``diagnosis()`` method and ``verdicts`` whose
    ``last_step`` is not None (it has judged a logged step): TransformerStability and
    LayerHealth do. Found by that protocol, not by class, so that this module imports no
    callback (the anomaly report, which calls it, is imported by the callbacks it would import).

    None when no callback has judged a step yet, or on a rank other than zero (they judge on
    rank zero).
    """
    if not getattr(trainer, "is_global_zero", True):
        return None
    for callback in getattr(trainer, "callbacks", ()):
        diagnosis = getattr(callback, "diagnosis", None)
        if callable(diagnosis) and getattr(getattr(callback, "verdicts", None), "last_step", None) is not None:
            return diagnosis()
    return None
