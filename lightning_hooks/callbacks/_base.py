"""HookCallback: the hook lifecycle every callback of this package shares, with its step clock (``_steps``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional
from weakref import WeakKeyDictionary, ref

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_hooks.callbacks._steps import (
    Moment,
    _is_logged_step,
    _log_interval,
    _validate_interval,
    acting_late,
    log_step,
    moment,
)
from lightning_hooks.core._compat import CALLBACK_BASES, configure_model_overridden
from lightning_hooks.core._torch_internals import is_compiled
from lightning_hooks.core._validation import check_names
from lightning_hooks.core.selection import ModuleSelection, select_modules, stack_blocks, validate_selection
from lightning_hooks.measure._sharding import note_flat_shards

__all__ = [
    "HookCallback", "Moment", "_log_interval", "_validate_interval", "_validate_stats", "acting_late", "claim",
    "log_step", "moment", "owns", "release",
]


def _validate_stats(stats: Any, allowed: Sequence[str]) -> None:
    """Check a ``stats`` argument: a list of names from ``allowed``."""
    if isinstance(stats, str):
        raise TypeError(
            f"`stats` must be a list of names, not the string {stats!r} (read letter by letter, as the"
            f" unknown stats {list(stats)}); write stats=[{stats!r}]"
        )
    check_names("stats", stats, allowed, allow_empty=True, what="stat")


def _remove(handles: list[RemovableHandle]) -> None:
    """Remove ``handles`` from their modules and forget them."""
    for handle in handles:
        handle.remove()
    handles.clear()


#: The Trainer running each callback instance, from its ``setup`` to its ``teardown``; kept apart from the
#: instance, so that copying or pickling a callback is not affected.
_OWNERS: WeakKeyDictionary[Any, ref[Any]] = WeakKeyDictionary()


def claim(callback: Any, trainer: Any) -> None:
    """Note that ``trainer`` runs ``callback`` from its ``setup`` on; one Trainer at a time.

    Raises:
        RuntimeError: If another Trainer still runs it (a ``fit`` inside a ``fit``: one instance
            holds one run's hooks and state, and the inner run would take them from the outer).
    """
    if not owns(callback, trainer):
        raise RuntimeError(
            f"{type(callback).__name__}: this instance is attached to another Trainer that is still running (a"
            " `fit` called inside a `fit`, from a callback or a training_step?). Give each Trainer its own instance:"
            " an instance holds one run's hooks and state.")
    _OWNERS[callback] = ref(trainer)


def owns(callback: Any, trainer: Any) -> bool:
    """Whether ``trainer`` may run ``callback``: no other live Trainer has claimed it."""
    owner = _OWNERS.get(callback)
    current = owner() if owner is not None else None
    return current is None or current is trainer


def release(callback: Any, trainer: Any) -> None:
    """Let another Trainer run ``callback`` (``teardown`` or ``on_exception`` of the Trainer that claimed it)."""
    if owns(callback, trainer):
        _OWNERS.pop(callback, None)


class HookCallback(*CALLBACK_BASES):  # type: ignore[misc]  # the Callback of each Lightning package
    """Base class: resolve a module selection, register hooks on fit start, remove them on exit.

    The selection is resolved in :meth:`setup`, so a pattern that matches nothing fails before
    training starts. Hooks go on the LightningModule's own submodules (never on a DDP or FSDP
    wrapper), are registered in ``on_fit_start`` and removed in ``on_fit_end``,
    ``on_exception`` and ``teardown``. Removal is idempotent, a second ``fit`` never registers
    twice, and hooks the user registered are left alone.

    Every observing hook goes through :meth:`_guard`: it returns at once while the callback is
    not collecting, and an exception inside it warns once and disables that module's hook
    instead of killing the run.

    The hooks of :meth:`_register` are on the modules only while the callback collects (its gate,
    ``_collecting``, is open: a logged step, a validation run when asked), and removed when it
    stops: a registered hook alone puts every call of its module on PyTorch's slow path, so the
    steps not logged run the modules bare. Registering costs a few microseconds per module, on
    the steps that log only. Where the model holds a module compiled with ``torch.compile`` the
    hooks stay registered for the whole fit, gated by the flag alone: a compiled graph either
    recompiles when its hooks change or (torch's default, ``skip_nnmodule_hook_guards``) keeps
    running without the hooks added after it was compiled, so their figures would be lost.
    Subclasses whose hooks act on every step (gradient transforms) or only exist for a whole
    stage set ``_hooks_follow_gate = False``.

    Subclasses implement :meth:`_register`, which returns the handles of the hooks it added.

    Args:
        modules: Which modules to hook; see :func:`lightning_hooks.core.selection.select_modules`.

    Raises:
        TypeError: If ``modules`` has the wrong type.
        ValueError: If ``modules`` is an empty list or holds an empty pattern.
    """

    def __init__(self, modules: ModuleSelection = None) -> None:
        validate_selection(modules)
        self.modules = modules
        self._targets: list[tuple[str, nn.Module]] = []
        self._stack_ids: set[int] = set()  # the ``id`` of each block of a stack among the default targets
        self._handles: list[RemovableHandle] = []  # on the model for the whole fit
        self._gated: list[RemovableHandle] = []  # on the model while the gate is open
        self._armed = False  # attached, with the gated hooks registered whenever the gate opens
        self._failed: set[str] = set()
        # Gated hooks return at once while this is False. Read through `_collecting`, whose
        # setter registers and removes the gated hooks; torch.compile guards on the flag alone.
        self._gate = False

    #: Whether the hooks of :meth:`_register` are on the modules only while the gate is open.
    _hooks_follow_gate = True

    #: Whether the default selection (``modules=None``) takes each block of a stack too
    #: (:func:`~lightning_hooks.core.selection.stack_blocks`): a monitor of outputs sees the residual stream.
    _watches_blocks = False

    #: The last log step this callback logs, whatever its interval (after an anomaly; see :meth:`watch_until`).
    _watched_until = -1

    def watch_until(self, step: int) -> None:
        """Log every step up to log step ``step``, whatever the interval (``GradientAnomalyStopping(watch_after=)``)."""
        self._watched_until = max(step, self._watched_until)

    def _is_logged(self, trainer: pl.Trainer, every: int) -> bool:
        """Whether the step running now is logged at an interval of ``every`` (0: never), or watched closely."""
        return self._logs_at(log_step(trainer), every)

    def _is_logged_next(self, trainer: pl.Trainer, every: int) -> bool:
        """Whether the step after the one running now is logged (see :meth:`_is_logged`)."""
        return self._logs_at(log_step(trainer) + 1, every)

    def _logs_at(self, step: int, every: int) -> bool:
        """Whether log step ``step`` is logged at an interval of ``every`` (0: never), or watched closely."""
        return _is_logged_step(step, every) or (every > 0 and step <= self._watched_until)

    @property
    def _collecting(self) -> bool:
        """Whether the gate is open: the observing hooks run (and are registered) only then."""
        return self._gate

    @_collecting.setter
    def _collecting(self, value: bool) -> None:
        self._gate = value
        if value and self._armed and not self._gated:
            self._gated = self._register_all()
        elif not value and self._gated:
            _remove(self._gated)

    def _close_gate(self, reopens: bool) -> None:
        """Close the gate; with ``reopens`` (the next step logs too) the gated hooks stay on, returning at once.

        Removing a thousand hooks to register them again a moment later costs their handles, and
        with them the garbage collector's passes, at every step of a monitor logging every step.
        Whoever opens the gate for a step closes it (with ``_collecting = False``) where that step
        does not log after all, so the hooks are never on a step that does not use them.
        """
        if reopens:
            self._gate = False
        else:
            self._collecting = False

    @property
    def module_names(self) -> list[str]:
        """Qualified names of the selected modules, in registration order."""
        return [name for name, _ in self._targets]

    @property
    def is_attached(self) -> bool:
        """Whether this callback is attached to a model (its gated hooks registered there or not right now)."""
        return self._armed or bool(self._handles)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the module selection, so a bad pattern fails before any training.

        A LightningModule that builds its layers in ``configure_model`` (which Lightning runs
        after ``setup``) is resolved in ``on_fit_start`` instead, still before the first step.
        """
        claim(self, trainer)
        if not configure_model_overridden(pl_module):
            self._targets = select_modules(pl_module, self.modules, blocks=self._watches_blocks)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the hooks (after noting FSDP1's shards: its root unit wraps ``pl_module``)."""
        note_flat_shards(trainer.model if trainer.model is not None else pl_module)
        self._watched_until = -1  # log steps count from 0 again
        self.attach(pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Remove the hooks."""
        self.detach()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Remove the hooks when ``fit`` raises (Lightning skips ``on_fit_end`` then); not another Trainer's."""
        if owns(self, trainer):  # a nested fit refused in `setup` must leave the outer run its hooks
            self.detach()
            release(self, trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Remove the hooks on every way out; free the instance for another Trainer."""
        if owns(self, trainer):
            self.detach()
            release(self, trainer)

    def attach(self, model: nn.Module) -> None:
        """Register this callback's hooks on ``model``, replacing any it registered before."""
        self.detach()
        self._targets = select_modules(model, self.modules, blocks=self._watches_blocks)
        self._stack_ids = stack_blocks(model) if self._watches_blocks and self.modules is None else set()
        self._failed.clear()
        self._hook_targets(model)

    def _hook_targets(self, model: nn.Module) -> None:
        """Register the hooks of :meth:`_register_all`: now for the whole fit, or whenever the gate opens."""
        if self._hooks_follow_gate and not is_compiled(model):
            self._armed = True
            if self._gate:
                self._gated = self._register_all()
        else:
            self._handles.extend(self._register_all())

    def _register_all(self) -> list[RemovableHandle]:
        """Register the hooks of every target, and return their handles."""
        return [handle for index, (name, module) in enumerate(self._targets)
                for handle in self._register(index, name, module)]

    def detach(self) -> None:
        """Remove every hook this callback registered. Safe to call any number of times."""
        self._armed = False
        _remove(self._handles)
        _remove(self._gated)

    def _register(self, index: int, name: str, module: nn.Module) -> list[RemovableHandle]:
        """Register the hooks for one selected module and return their handles."""
        raise NotImplementedError

    def _guard(self, name: str, hook: Callable[..., Any]) -> Callable[..., Optional[Any]]:
        """Wrap an observing ``hook``: skipped while not collecting, disabled once it raises.

        The hook returns at once while the gate (``self._collecting``) is closed. An exception warns once
        and disables the hook registered under ``name`` for the rest of the fit. Hooks that
        change training (gradient transforms) are never wrapped: they must fail loudly.
        """

        def guarded(*args: Any) -> Optional[Any]:
            if not self._gate or name in self._failed:
                return None
            try:
                return hook(*args)
            except Exception as err:  # a monitor must never kill the training run
                self._failed.add(name)
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
                warnings.warn(
                    f"{type(self).__name__}: the hook on {name!r} raised {type(err).__name__}: {err}"
                    f" (rank {rank}). It is disabled for the rest of this fit.",
                    stacklevel=2,
                )
                return None

        return guarded
