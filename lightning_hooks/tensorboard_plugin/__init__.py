"""The Layers tab: a TensorBoard plugin that shows every layer's health over training, with verdicts.

Installed with the package and found by TensorBoard through the ``tensorboard_plugins`` entry
point: ``tensorboard --logdir runs`` shows a LAYERS tab for runs that ActivationMonitor or
GradientMonitor wrote.
"""

from lightning_hooks.tensorboard_plugin.plugin import PLUGIN_NAME, LayersPlugin
from lightning_hooks.tensorboard_plugin.verdicts import Thresholds

__all__ = ["PLUGIN_NAME", "LayersPlugin", "Thresholds"]
