"""Where an AnomalyReport finds the diagnosis so far: TransformerStability's, else LayerHealth's summary."""

from __future__ import annotations

from typing import Any, Optional


def diagnosis_so_far(trainer: Any) -> Optional[str]:
    """The diagnosis of the first TransformerStability in ``trainer.callbacks``, else of the first LayerHealth.

    None when neither is there, on a rank other than zero (they judge on rank zero), or before
    either has judged a logged step.
    """
    # Imported here: stopping and gradients import the anomaly report, and health imports gradients.
    from lightning_hooks.callbacks.health import LayerHealth
    from lightning_hooks.callbacks.stability import TransformerStability

    if not getattr(trainer, "is_global_zero", True):
        return None
    callbacks = list(getattr(trainer, "callbacks", ()))
    stability = next((cb for cb in callbacks if isinstance(cb, TransformerStability)), None)
    if stability is not None and stability.verdicts.last_step is not None:
        return stability.diagnosis()
    health = next((cb for cb in callbacks if isinstance(cb, LayerHealth)), None)
    if health is not None and health.verdicts.last_step is not None:
        return health.summary()
    return None
