"""Lightning callbacks that look inside a model while it trains, through PyTorch module hooks.

The public names are imported when first used (PEP 562), so that importing a part of the
package that needs neither torch nor Lightning, such as the Layers tab that TensorBoard loads
at start-up, does not import them (about 6 s).

Reports, verdicts and diagnoses go through Python's ``logging``, under the logger
``"lightning_hooks"``: route or silence them there (``logging.getLogger("lightning_hooks")
.setLevel(logging.WARNING)``). They are shown at INFO on stderr while the root logger has no
handler; once the application configures logging (before or after the import) they go to its
handlers instead, as every logger's records do.
"""

from __future__ import annotations

import importlib
import logging
import sys
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
    from lightning_hooks.callbacks.updates import UpdateTransform
    from lightning_hooks.core.selection import ACTIVATION_NAMES, ACTIVATION_TYPES, ModuleSelection, select_modules
    from lightning_hooks.measure.anomalies import FLAG_NAMES
    from lightning_hooks.measure.spikes import SpikeTrigger
    from lightning_hooks.measure.stats import DEFAULT_STATS, DIVERGENCE_STATS, STAT_NAMES
    from lightning_hooks.output.fast_tensorboard import FastTensorBoardLogger

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
    "UpdateTransform": "callbacks.updates",
    "TransformerStability": "callbacks.stability",
    **dict.fromkeys(("ACTIVATION_NAMES", "ACTIVATION_TYPES", "ModuleSelection", "select_modules"), "core.selection"),
    "FLAG_NAMES": "measure.anomalies",
    "FastTensorBoardLogger": "output.fast_tensorboard",
    **dict.fromkeys(("DEFAULT_STATS", "DIVERGENCE_STATS", "STAT_NAMES"), "measure.stats"),
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
    "FastTensorBoardLogger",
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
    "UpdateTransform",
    "iter_features",
    "load_features",
    "select_modules",
]
__version__ = "0.1.0"


class _StderrUntilConfigured(logging.StreamHandler):  # type: ignore[type-arg]
    """Write a record to stderr only while the root logger has no handler, checked at each record.

    The records still propagate: once the application configures logging (``logging.basicConfig``,
    before or after importing the package) its handlers show them, and this one stays quiet, so
    nothing is printed twice.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            self.setStream(sys.stderr)  # the current one (a test's or a notebook's capture)
            super().emit(record)


_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not any(type(h).__name__ == "_StderrUntilConfigured" for h in _logger.handlers):  # once, even if reloaded
    _logger.addHandler(_StderrUntilConfigured())


def __getattr__(name: str) -> Any:
    """Import a public name from its module at first use, then keep it here."""
    if name not in _WHERE:
        raise AttributeError(f"module 'lightning_hooks' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lightning_hooks.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
