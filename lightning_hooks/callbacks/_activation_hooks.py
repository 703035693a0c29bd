"""ActivationMonitor's module hooks: what runs inside the model's forward on a step it logs.

Each watched module gets a forward hook that adds what the module returned to its row of the
step's :class:`~lightning_hooks.measure.aggregate.StatBlock` (and, with ``gradients``, puts tensor
hooks on its outputs: ``_activation_grads.py``), and with ``inputs`` a forward pre-hook that adds
its positional inputs. When they are on the modules, which step's block they write into and how
it is logged is :class:`~lightning_hooks.ActivationMonitor`'s (``activations.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_hooks.callbacks._activation_grads import watch_output_gradients
from lightning_hooks.callbacks._base import HookCallback
from lightning_hooks.core._torch_internals import in_backward
from lightning_hooks.measure.aggregate import StatBlock


def note_call(order: dict[str, None], name: str, module: nn.Module) -> None:
    """Add a module's call to the forward order: a module at its first call, a parameter-free one at its last.

    A parameter-free module called again (one ``ReLU`` a model applies after several layers, as torchvision's
    ResNet blocks and many MLPs do) computes nothing of its own: its outputs follow whatever fed its calls,
    the later calls too, so it ranks after them, a victim of a fault there rather than a module before it.
    A module with parameters called again (a layer shared across depth, as ALBERT's) keeps its first call's place.
    """
    if name not in order:
        order[name] = None
    elif next(module.parameters(), None) is None:
        del order[name]
        order[name] = None


class ActivationHooks(HookCallback):
    """The hooks of :class:`~lightning_hooks.ActivationMonitor` on its modules, made once per fit.

    They write into ``_block`` (None: nothing is collected), the training block's gradient rows
    with ``gradients``, and the modules' forward order into ``_forward_order`` (``note_call``); row
    ``index`` is the module's output, ``index + n`` its input, after those its gradient.
    """

    inputs: bool
    gradients: bool
    _block: Optional[StatBlock]
    _blocks: dict[str, StatBlock]
    _forward_order: Optional[dict[str, None]]
    _ordering: bool
    _stack_ids: set[int]
    _grad_scale: list[Optional[torch.Tensor]]
    _hook_fns: dict[tuple[int, str, int, bool], tuple[Callable[..., Any], Callable[..., Any]]]

    def _register(self, index: int, name: str, module: nn.Module) -> list[RemovableHandle]:
        # The hook functions are made once per fit, not at each logged step: a thousand new closures
        # a step outlive a few collections and set off the garbage collector's full passes.
        block = id(module) in self._stack_ids
        key = (index, name, len(self._targets), block)
        hooks = self._hook_fns.get(key)
        if hooks is None:
            hooks = self._hook_fns[key] = self._hooks(index, name, block)
        handles = [module.register_forward_hook(hooks[0])]
        if self.inputs:
            handles.append(module.register_forward_pre_hook(hooks[1]))
        return handles

    def _hooks(self, index: int, name: str, block: bool = False) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The guarded forward hook and input pre-hook of the module ``name``, row ``index``.

        ``block``: a block of a stack, whose row is the residual stream it hands on: of a tuple it returns
        (transformers 4's ``(hidden_states, present, ...)``, the cache beside the stream), the first item only.
        """
        input_index = index + len(self._targets)
        grad_index = index + len(self._targets) * (1 + self.inputs)

        def record(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._block is not None and not in_backward():
                if block and isinstance(output, tuple) and output:
                    output = output[0]
                self._block.add_all(index, output)
                if self.gradients and self._block is self._blocks.get("train") and torch.is_grad_enabled():
                    watch_output_gradients(output, self._block, grad_index, self._grad_scale)
                # Not while torch.compile traces: a dict that changes, then goes, would cost a third graph.
                if not torch.compiler.is_compiling() and self._ordering and self._forward_order is not None:
                    note_call(self._forward_order, name, mod)

        # A pre-hook, as an in-place module (ReLU(inplace=True)) has overwritten its input by
        # the time a forward hook runs.
        def record_inputs(mod: nn.Module, args: tuple[Any, ...]) -> None:
            if self._block is not None and not in_backward():
                self._block.add_all(input_index, args)

        return self._guard(name, record), self._guard(name, record_inputs)
