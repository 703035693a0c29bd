"""One set of callbacks for both Lightning packages: ``lightning.pytorch`` and ``pytorch_lightning``.

The two packages ship the same classes under different names, and each Trainer checks its
own: ``pytorch_lightning.Trainer(callbacks=cb)`` wraps ``cb`` in a list only if it is a
``pytorch_lightning.Callback``, its LightningCLI accepts only those, and each package's
``is_overridden`` rejects the other's LightningModule. So every test against a Lightning class
here takes a tuple holding the class from each package that is installed.
"""

from __future__ import annotations

from typing import Any, TypeVar

import lightning.pytorch as lp
import torch
from lightning_utilities.core.overrides import is_overridden
from torch import Tensor
from torchmetrics import Metric

try:
    import pytorch_lightning as ptl
except ImportError:  # the standalone package is optional
    ptl = None  # type: ignore[assignment]

_Kind = TypeVar("_Kind")

_PACKAGES: tuple[Any, ...] = (lp,) if ptl is None else (lp, ptl)

#: The Callback base class of each installed package; HookCallback derives from all of them.
CALLBACK_BASES: tuple[type[lp.Callback], ...] = tuple(package.Callback for package in _PACKAGES)

#: LightningModule of each installed package.
LIGHTNING_MODULES: tuple[type[lp.LightningModule], ...] = tuple(package.LightningModule for package in _PACKAGES)

#: TensorBoardLogger of each installed package (Any: the classes are unrelated, their interfaces the same).
TENSORBOARD_LOGGERS: tuple[type[Any], ...] = tuple(package.loggers.TensorBoardLogger for package in _PACKAGES)

#: CSVLogger of each installed package.
CSV_LOGGERS: tuple[type[Any], ...] = tuple(package.loggers.CSVLogger for package in _PACKAGES)

#: WandbLogger of each installed package.
WANDB_LOGGERS: tuple[type[Any], ...] = tuple(package.loggers.WandbLogger for package in _PACKAGES)


def configure_model_overridden(module: Any) -> bool:
    """Whether ``module``, a LightningModule of either package, builds its layers in ``configure_model``.

    Example::

        if not configure_model_overridden(pl_module):
            targets = select_modules(pl_module, "encoder.*")
    """
    parent = next((cls for cls in LIGHTNING_MODULES if isinstance(module, cls)), None)
    return parent is not None and is_overridden("configure_model", module, parent)


class BarCount(Metric):
    """The latest value of a count, carried to the progress bar as an int.

    ``LightningModule.log`` turns every number and tensor into a float; a torchmetrics Metric's
    result reaches the bar as it is, an int (TQDM writes ``anomalies=3``; Rich writes every
    number with its theme's ``metrics_format``, ``3.000`` by default). It lives on
    the CPU, so showing a new value never copies to an accelerator. Ranks agree on the counts
    this carries; where they would not, the sync takes the largest.

    Example::

        shown = BarCount()
        shown(3)  # forward: the value becomes the metric's result
        pl_module.log("anomalies", shown, prog_bar=True, logger=False, metric_attribute="anomalies")
    """

    full_state_update = True  # an update replaces the value, so forward keeps the latest, not a sum
    count: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("count", torch.tensor(0), dist_reduce_fx="max")

    def update(self, value: int) -> None:
        """Replace the value."""
        self.count = torch.tensor(value)

    def compute(self) -> Tensor:
        """The latest value, an int64 tensor."""
        return self.count


def callbacks_of(trainer: Any, kind: type[_Kind]) -> list[_Kind]:
    """The callbacks of ``trainer`` that are a ``kind``, in their order: how a callback finds another.

    The one rule (docs/architecture.md): a callback finds another in ``trainer.callbacks``, by
    ``isinstance`` against a class. A file that must not import the callback it looks for (it
    sits below it) declares a role for it instead: a base class the callback derives from
    (``FigureListener``, ``Diagnoses``) or a runtime-checkable Protocol it meets (``Judges``).
    Never by class name, never by ``getattr`` on whatever is there, never through a registry of
    our own.

    Args:
        trainer: The Trainer (anything with ``callbacks``; none is no callback).
        kind: The class or runtime-checkable Protocol looked for.

    Returns:
        The callbacks that are a ``kind``, in the order of ``trainer.callbacks``.

    Example::

        stopper = next(iter(callbacks_of(trainer, GradientAnomalyStopping)), None)
    """
    return [callback for callback in getattr(trainer, "callbacks", ()) if isinstance(callback, kind)]
