"""Every private PyTorch, FSDP and TensorBoard API the package touches, in one place.

Each is a name with a leading underscore in its library: it may change in any release. Keeping
them here means a new torch or TensorBoard release is checked against one file, and each use
says what it needs in words. ``torch._foreach_*`` ops are not here: they are the documented fast
path of ``torch.nn.utils.clip_grad_norm_`` and of torch's optimizers. Nor is torch's
``SummaryWriter._get_file_writer``, which the package's own ``FastSummaryWriter`` overrides
(``output/fast_tensorboard.py``): a method of a class the package owns, not a call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn


def grad_scaler_state(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The AMP scaler's bookkeeping for ``optimizer``: its ``"stage"`` and ``"found_inf_per_device"``.

    ``GradScaler._per_optimizer_states``: torch offers no public way to ask whether ``unscale_``
    already ran for an optimizer this step, nor what it found.
    """
    return scaler._per_optimizer_states[id(optimizer)]


def fsdp1_ignored_parameters(unit: nn.Module) -> tuple[nn.Parameter, ...]:
    """The parameters an FSDP1 unit was told to leave unsharded (``ignored_states``), or none.

    ``FullyShardedDataParallel._ignored_params``: the constructor's argument is not kept publicly.
    """
    return tuple(getattr(unit, "_ignored_params", ()))


def set_grad_mode(enabled: bool) -> None:
    """Turn autograd's grad mode on or off, with no context object (``torch.no_grad()`` makes one at each use)."""
    torch._C._set_grad_enabled(enabled)


def is_view(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor's storage (``Tensor._is_view``)."""
    return tensor._is_view()


def in_backward() -> bool:
    """Whether autograd is running a backward pass right now.

    Forwards inside backward are gradient checkpointing recomputing outputs that were already
    seen. Not checked while torch.compile traces, so dynamo never sees the private call
    (``torch._C._current_graph_task_id``).
    """
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def is_compiled(model: nn.Module) -> bool:
    """Whether ``torch.compile`` compiles ``model`` or a module inside it.

    A ``torch.compile(module)`` wrapper (``torch._dynamo.eval_frame.OptimizedModule``), a module
    compiled in place (``nn.Module.compile``, which sets ``_compiled_call_impl``), or a
    LightningModule that Lightning compiles (``_compiler_ctx``). A compiled function that calls
    the model is not seen.
    """
    if getattr(model, "_compiler_ctx", None):
        return True
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


def in_torch_func(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a ``torch.func`` transform's wrapper, which only the dispatcher unwraps.

    ``torch._C._functorch.is_functorch_wrapped_tensor``: torch has no public way to ask.
    """
    return _functorch_wrapped(tensor)


def torch_modes_on() -> bool:
    """Whether a torch function mode or dispatch mode is on: it would see every call that goes through torch.

    ``torch._C._len_torch_function_stack``, ``torch._C._len_torch_dispatch_stack``: torch has no
    public way to ask. Code that reads a tensor's memory itself (the statistics kernel's eager
    path) goes through the dispatcher instead while one is.
    """
    return bool(_function_modes() or _dispatch_modes())


_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_function_modes, _dispatch_modes = torch._C._len_torch_function_stack, torch._C._len_torch_dispatch_stack


def event_queue(summary_writer: Any) -> Optional[Callable[[bytes], None]]:
    """Where an ``Event``'s wire bytes go to be written by TensorBoard's writer thread; None where unsure.

    ``EventFileWriter.add_event`` serializes an event and hands the bytes to
    ``EventFileWriter._async_writer.write``; this returns that ``write`` (TensorBoard takes no
    event as bytes), reached through torch's ``SummaryWriter._get_file_writer``. Only for
    TensorBoard's own ``EventFileWriter`` class (a subclass may change what ``add_event``
    does), and only where every one of those names is found: anything else gets None, and the
    caller writes through the writer's public methods. Nothing is changed on the writer.
    """
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    get_file_writer = getattr(summary_writer, "_get_file_writer", None)
    if not callable(get_file_writer):
        return None
    event_writer = getattr(get_file_writer(), "event_writer", None)
    if type(event_writer) is not EventFileWriter:
        return None
    write = getattr(getattr(event_writer, "_async_writer", None), "write", None)
    return write if callable(write) else None
