"""Host transfers per logged and per non-logged step, per callback, counted by a ``TorchFunctionMode``.

See ``benchmarks/README.md`` ("Host transfers") for what counts as a transfer and whom it is
charged to.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import sys
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from harness import CPU, Config, Device, Workload, run_fit
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_T = torch.Tensor
_READS = {_T.item, _T.tolist, _T.numpy, _T.__bool__, _T.__float__, _T.__int__, _T.__index__,
          _T.__array__, _T.__format__, _T.__repr__}
_TO_HOST = {_T.cpu}
_DATA_DEPENDENT = {torch.nonzero, _T.nonzero, torch.masked_select, _T.masked_select, torch.unique,
                   _T.unique, torch.argwhere, _T.argwhere, torch.repeat_interleave}


class TransferCounter(TorchFunctionMode):
    """Counts device-to-host transfers, per step and per callback that caused them.

    On a CPU-only machine every tensor is on the host, so "would be a sync on an accelerator" is
    tracked by hand: tensors are device-resident unless proven host-resident (made by a factory
    without ``device=``, computed only from host tensors, or the result of ``.cpu()`` /
    ``.to("cpu")``). A transfer is ``.item()``, ``.tolist()``, ``.numpy()``, ``bool()``,
    ``float()``, ``int()``, ``.cpu()``, ``.to("cpu")``, a boolean-mask index or a data-dependent
    shape op (``nonzero``, ``masked_select``, ``unique``) on a device-resident tensor. Calls are
    attributed to the innermost frame on the stack from a module named in ``owners`` (a
    module-name prefix -> the owner to charge, or None for the callback object found above the
    frame); other code's transfers (Lightning's own) are not counted.
    """

    def __init__(self, owners: Mapping[str, Optional[str]]) -> None:
        super().__init__()
        self.owners = dict(owners)
        self.step = -1
        self.counts: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.sites: dict[str, int] = defaultdict(int)
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark_host(self, value: Any) -> None:
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor) and not self._is_host(t):
                self._host[id(t)] = weakref.ref(t, functools.partial(self._forget, id(t)))

    def _forget(self, key: int, _: Any) -> None:
        self._host.pop(key, None)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device_in = [t for t in tensors if not self._is_host(t)]
        to_host, to_device, kind = False, False, None
        if func in _READS and device_in:
            kind = "read"
        elif func in _TO_HOST:
            to_host, kind = True, ("copy" if device_in else None)
        elif func is _T.to:
            targets = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, (str, torch.device))]
            to_host = any(isinstance(a, str) and a.startswith("cpu") for a in targets)
            to_device = bool(targets) and not to_host  # `.to(some_tensor.device)`: the accelerator, on a GPU
            kind = "copy" if to_host and device_in else None
        elif func in _DATA_DEPENDENT and device_in:
            kind = "shape"
        elif func is _T.__getitem__ and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                             for i in tree_flatten(args[1:])[0]) and device_in:
            kind = "shape"
        if kind is not None:
            self._record(kind)
        out = func(*args, **kwargs)
        if (to_device and self._is_host(out) or to_host and not self._is_host(out)) and out is args[0]:
            out = out.clone()  # on CPU `.to(cpu)`, `.cpu()` return self; on an accelerator they copy
        if to_host or not to_device and (tensors and not device_in or not tensors and kwargs.get("device") is None):
            self._mark_host(out)
        return out

    def _record(self, kind: str) -> None:
        frame: Any = sys._getframe(2)
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            prefix = next((p for p in self.owners if name.startswith(p)), None)
            if prefix is not None:
                code = frame.f_code
                owner = self.owners[prefix] or self._owner(frame)
                self.counts[self.step][owner] += 1
                self.sites[f"{owner} | {kind} | {Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"] += 1
                return
            frame = frame.f_back

    @staticmethod
    def _owner(frame: Any) -> str:
        while frame is not None:
            this = frame.f_locals.get("self")
            if isinstance(this, Callback):
                return type(this).__name__
            frame = frame.f_back
        return "lightning_hooks"


class StepMarker(Callback):
    """Tells the host-transfer counter which step is running."""

    def __init__(self, counter: TransferCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.counter.step = trainer.global_step


_BACKWARD_HOOK_REGISTRARS = [
    (torch.Tensor, "register_hook"), (torch.Tensor, "register_post_accumulate_grad_hook"),
    (nn.Module, "register_full_backward_hook"), (nn.Module, "register_full_backward_pre_hook"),
]


@contextlib.contextmanager
def _modes_in_backward_hooks(mode: TorchFunctionMode) -> Iterator[None]:
    """Autograd runs backward hooks without the caller's function modes: re-enter ``mode`` there."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in _BACKWARD_HOOK_REGISTRARS]

    def patched(register: Callable[..., Any]) -> Callable[..., Any]:
        def register_wrapped(self: Any, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if getattr(hook, "_in_mode", False):  # Tensor.register_hook re-dispatches through the mode
                return register(self, hook, *args, **kwargs)

            def run(*hook_args: Any, **hook_kwargs: Any) -> Any:
                with mode:
                    return hook(*hook_args, **hook_kwargs)
            run._in_mode = True  # type: ignore[attr-defined]
            return register(self, run, *args, **kwargs)
        return register_wrapped

    for owner, name, original in originals:
        setattr(owner, name, patched(original))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def count_transfers(workload: Workload, config: Config, n_steps: int, tmp: str, version: str,
                    owners: Mapping[str, Optional[str]], device: Device = CPU) -> dict[str, Any]:
    """Host transfers per logged / non-logged step, per callback, over ``n_steps`` steps of one fit.

    ``owners`` says whose code is counted; see :class:`TransferCounter`.
    """
    counter = TransferCounter(owners)
    with _modes_in_backward_hooks(counter), counter:
        run_fit(workload, config, n_steps, tmp, version, device, extra=[StepMarker(counter)])
    result: dict[str, Any] = {"per_callback": {}, "sites": dict(counter.sites)}
    for owner in sorted({o for per_step in counter.counts.values() for o in per_step}):
        logged = [counter.counts[s].get(owner, 0) for s in range(n_steps) if config.logged(s)]
        quiet = [counter.counts[s].get(owner, 0) for s in range(n_steps) if not config.logged(s)]
        result["per_callback"][owner] = {
            "logged": statistics.mean(logged) if logged else None,
            "non_logged": statistics.mean(quiet) if quiet else None,
        }
    return result
