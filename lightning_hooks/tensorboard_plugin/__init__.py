"""The Layers tab: a TensorBoard plugin that shows every layer's health over training, with verdicts.

Installed with the package and found by TensorBoard through the ``tensorboard_plugins`` entry
point: ``tensorboard --logdir runs`` shows a LAYERS tab for runs that ActivationMonitor or
GradientMonitor wrote. It judges with LayerHealth's bands (:class:`Bands`), from one place.
"""

from lightning_hooks.output._health_verdicts import Bands
from lightning_hooks.tensorboard_plugin.plugin import PLUGIN_NAME, LayersPlugin

__all__ = ["PLUGIN_NAME", "Bands", "LayersPlugin"]
