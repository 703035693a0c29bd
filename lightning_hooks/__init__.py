"""Lightning callbacks that look inside a model while it trains, through PyTorch module hooks."""

from lightning_hooks._anomaly_report import AnomalyReport
from lightning_hooks._base import HookCallback
from lightning_hooks.activations import ActivationMonitor
from lightning_hooks.anomalies import (
    FLAG_NAMES,
    AnomalyDetector,
    GradientFigures,
    anomaly_flags,
    gradient_figures,
)
from lightning_hooks.features import FeatureExtractor, load_features
from lightning_hooks.gradients import GRADIENT_STAT_NAMES, GradientMonitor
from lightning_hooks.health import LayerHealth
from lightning_hooks.selection import ACTIVATION_NAMES, ACTIVATION_TYPES, ModuleSelection, select_modules
from lightning_hooks.stats import DEFAULT_STATS, DIVERGENCE_STATS, STAT_NAMES, histogram_edges
from lightning_hooks.stopping import GradientAnomalyError, GradientAnomalyStopping
from lightning_hooks.transforms import GradientTransform

__all__ = [
    "ACTIVATION_NAMES",
    "ACTIVATION_TYPES",
    "DEFAULT_STATS",
    "DIVERGENCE_STATS",
    "FLAG_NAMES",
    "GRADIENT_STAT_NAMES",
    "STAT_NAMES",
    "ActivationMonitor",
    "AnomalyDetector",
    "AnomalyReport",
    "FeatureExtractor",
    "GradientAnomalyError",
    "GradientAnomalyStopping",
    "GradientFigures",
    "GradientMonitor",
    "GradientTransform",
    "HookCallback",
    "LayerHealth",
    "ModuleSelection",
    "anomaly_flags",
    "gradient_figures",
    "histogram_edges",
    "load_features",
    "select_modules",
]
__version__ = "0.1.0"
