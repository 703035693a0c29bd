"""Lightning callbacks that look inside a model while it trains, through PyTorch module hooks.

The public names are imported when first used (PEP 562), so that importing a part of the
package that needs neither torch nor Lightning, such as the Layers tab that TensorBoard loads
at start-up, does not import them (about 6 s).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_hooks.callbacks._anomaly_report import AnomalyReport
    from lightning_hooks.callbacks._flight_recorder import FlightRecord
    from lightning_hooks.callbacks.activations import ActivationMonitor
    from lightning_hooks.callbacks.features import FeatureExtractor, MappedFeatures, iter_features, load_features
    from lightning_hooks.callbacks.gradients import GRADIENT_STAT_NAMES, GradientMonitor
    from lightning_hooks.callbacks.health import LayerHealth
    from lightning_hooks.callbacks.stability import TransformerStability
    from lightning_hooks.callbacks.stopping import GradientAnomalyError, GradientAnomalyStopping
    from lightning_hooks.callbacks.transforms import GradientTransform
    from lightning_hooks.core.selection import ACTIVATION_NAMES, ACTIVATION_TYPES, ModuleSelection, select_modules
    from lightning_hooks.measure.anomalies import FLAG_NAMES
    from lightning_hooks.measure.spikes import SpikeTrigger
    from lightning_hooks.measure.stats import DEFAULT_STATS, DIVERGENCE_STATS, STAT_NAMES

#: Each public name, by the module that defines it: the callbacks, what they hand the user (reports,
#: errors, saved features), the names their arguments take (stats, flags, module selections), and
#: ``select_modules`` to see what a selection matches.
_WHERE = {
    "AnomalyReport": "callbacks._anomaly_report",
    "FlightRecord": "callbacks._flight_recorder",
    "SpikeTrigger": "measure.spikes",
    "ActivationMonitor": "callbacks.activations",
    **dict.fromkeys(("FeatureExtractor", "MappedFeatures", "iter_features", "load_features"), "callbacks.features"),
    **dict.fromkeys(("GRADIENT_STAT_NAMES", "GradientMonitor"), "callbacks.gradients"),
    "LayerHealth": "callbacks.health",
    **dict.fromkeys(("GradientAnomalyError", "GradientAnomalyStopping"), "callbacks.stopping"),
    "GradientTransform": "callbacks.transforms",
    "TransformerStability": "callbacks.stability",
    **dict.fromkeys(("ACTIVATION_NAMES", "ACTIVATION_TYPES", "ModuleSelection", "select_modules"), "core.selection"),
    "FLAG_NAMES": "measure.anomalies",
    **dict.fromkeys(("DEFAULT_STATS", "DIVERGENCE_STATS", "STAT_NAMES"), "measure.stats"),
}

#: Names exported here before 0.2.0 that are internals now: still importable from here, with a
#: deprecation warning, until 0.3.0; always from the module named.
_DEPRECATED = {
    "HookCallback": "callbacks._base",
    **dict.fromkeys(("AnomalyDetector", "GradientFigures", "anomaly_flags", "gradient_figures"), "measure.anomalies"),
    "histogram_edges": "measure.stats",
}

__all__ = [
    "ACTIVATION_NAMES",
    "ACTIVATION_TYPES",
    "DEFAULT_STATS",
    "DIVERGENCE_STATS",
    "FLAG_NAMES",
    "GRADIENT_STAT_NAMES",
    "STAT_NAMES",
    "ActivationMonitor",
    "AnomalyReport",
    "FeatureExtractor",
    "FlightRecord",
    "GradientAnomalyError",
    "GradientAnomalyStopping",
    "GradientMonitor",
    "GradientTransform",
    "LayerHealth",
    "MappedFeatures",
    "ModuleSelection",
    "SpikeTrigger",
    "TransformerStability",
    "iter_features",
    "load_features",
    "select_modules",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import a public name from its module at first use, then keep it here."""
    if name in _DEPRECATED:  # not kept in globals(): every use warns
        from lightning_hooks.core._deprecation import deprecate

        where = f"lightning_hooks.{_DEPRECATED[name]}"
        deprecate(f"`lightning_hooks.{name}` is internal now and leaves the top-level API in 0.3.0;"
                              f" import it from `{where}` (not a stable API).", stacklevel=6)
        return getattr(importlib.import_module(where), name)
    if name not in _WHERE:
        raise AttributeError(f"module 'lightning_hooks' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_hooks.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
