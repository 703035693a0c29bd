"""Lightning callbacks that look inside a model while it trains, through PyTorch module hooks."""

from lightning_hooks._base import HookCallback
from lightning_hooks.activations import ActivationMonitor
from lightning_hooks.selection import ACTIVATION_TYPES, ModuleSelection, select_modules
from lightning_hooks.stats import STAT_NAMES, histogram_edges

__all__ = [
    "ACTIVATION_TYPES",
    "STAT_NAMES",
    "ActivationMonitor",
    "HookCallback",
    "ModuleSelection",
    "histogram_edges",
    "select_modules",
]
__version__ = "0.1.0"
