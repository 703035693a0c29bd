"""What FeatureExtractor saves of a layer's output: its tensors by name, pooled and cast (pure functions).

A layer's output is taken apart into named tensors: a tensor is saved under the module's name
(``"encoder.2"``), the tensors inside a tuple, list, dict or dataclass output under
``"<module>:<path>"`` (``"lstm:0"``, ``"encoder:hidden"``, ``"lstm:1.0"`` for nested ones).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch import Tensor

from lightning_hooks.core.selection import ModuleSelection

Reduce = Union[Literal["mean", "cls", "max"], Callable[[Tensor], Tensor]]
"""How to pool a saved tensor: a name, or a function taking the tensor (rows first) to one with the same rows."""

REDUCTIONS = ("mean", "cls", "max")


def named_tensors(output: Any, prefix: str = "") -> list[tuple[str, Tensor]]:
    """Return every tensor with a batch dim inside ``output``, depth first, with its path ("" for a bare tensor).

    Example::

        named_tensors((x, {"h": h}))  # [("0", x), ("1.h", h)]
    """
    if isinstance(output, Tensor):
        return [(prefix, output)] if output.dim() > 0 else []
    if isinstance(output, dict):
        items: Sequence[tuple[Any, Any]] = list(output.items())
    elif isinstance(output, (tuple, list)):
        items = list(enumerate(output))
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [(f.name, getattr(output, f.name)) for f in dataclasses.fields(output)]
    else:
        return []
    found = []
    for key, value in items:
        found.extend(named_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def output_name(module: str, path: str) -> str:
    """The name a tensor is saved under: the module's, with ``:path`` for one inside a structured output."""
    return f"{module}:{path}" if path else module


def split_selection(modules: ModuleSelection) -> tuple[ModuleSelection, tuple[str, ...]]:
    """Split ``"module:key"`` entries off a selection: the module globs, and the output-name globs.

    Example::

        split_selection(["encoder.2:hidden", "head"])  # (["encoder.2", "head"], ("encoder.2:hidden",))
    """
    items = [modules] if isinstance(modules, str) else modules
    if not isinstance(items, (list, tuple)):
        return modules, ()
    keyed = tuple(item for item in items if isinstance(item, str) and ":" in item)
    plain = [item.split(":", 1)[0] if isinstance(item, str) else item for item in items]
    return (plain[0] if isinstance(modules, str) else plain), keyed


def key_filter(module: str, keyed: Sequence[str]) -> Optional[tuple[str, ...]]:
    """The output-name globs that restrict ``module`` (None: save all its tensors)."""
    globs = tuple(g for g in keyed if fnmatch.fnmatchcase(module, g.split(":", 1)[0]))
    return globs or None


def wanted(name: str, globs: Optional[Sequence[str]]) -> bool:
    """Whether the output ``name`` passes the globs of :func:`key_filter`."""
    return globs is None or any(fnmatch.fnmatchcase(name, g) for g in globs)


def pool(tensor: Tensor, reduce: Optional[Reduce], dims: tuple[int, ...]) -> Tensor:
    """Pool ``tensor`` over ``dims`` (never dim 0, the rows); a tensor without those dims is returned as is.

    ``"mean"`` and ``"max"`` reduce the dims; ``"cls"`` takes index 0 along each (the first
    token); a callable gets the whole tensor and must keep its rows.

    Example::

        pool(torch.ones(4, 10, 8), "mean", (1,)).shape  # (4, 8)
    """
    if reduce is None:
        return tensor
    if callable(reduce):
        pooled = reduce(tensor)
        if not isinstance(pooled, Tensor) or pooled.dim() == 0 or pooled.shape[0] != tensor.shape[0]:
            got = tuple(pooled.shape) if isinstance(pooled, Tensor) else type(pooled).__name__
            raise ValueError(f"`reduce` must keep the {tensor.shape[0]} rows of dim 0, returned {got}")
        return pooled
    if tensor.dim() <= max(dims):
        return tensor
    if reduce == "cls":
        for dim in sorted(dims, reverse=True):
            tensor = tensor.select(dim, 0)
        return tensor
    if reduce == "max":
        return tensor.amax(dim=dims)
    return tensor.mean(dim=dims) if tensor.is_floating_point() else tensor.float().mean(dim=dims)


def check_reduce(reduce: Any, reduce_dim: Any) -> tuple[int, ...]:
    """Validate ``reduce`` and ``reduce_dim``; return the dims as a tuple.

    Raises:
        TypeError: If ``reduce`` is not None, a name or a callable, or ``reduce_dim`` not an int or tuple of ints.
        ValueError: If ``reduce`` is an unknown name or ``reduce_dim`` holds a dim below 1.
    """
    if reduce is not None and not callable(reduce):
        if not isinstance(reduce, str):
            raise TypeError(f"`reduce` must be one of {list(REDUCTIONS)}, a callable or None, got {reduce!r}"
                            f" ({type(reduce).__name__}): pass e.g. reduce='mean'")
        if reduce not in REDUCTIONS:
            raise ValueError(f"`reduce` must be one of {list(REDUCTIONS)}, a callable or None, got {reduce!r}")
    dims = (reduce_dim,) if isinstance(reduce_dim, int) and not isinstance(reduce_dim, bool) else reduce_dim
    if not isinstance(dims, tuple) or not dims or not all(isinstance(d, int) and not isinstance(d, bool)
                                                          for d in dims):
        raise TypeError(f"`reduce_dim` must be an int or a tuple of ints, got {reduce_dim!r}: pass e.g."
                        " reduce_dim=1 (tokens of (N, L, D)) or reduce_dim=(2, 3) (pixels of (N, C, H, W))")
    if min(dims) < 1:
        raise ValueError(f"`reduce_dim` must name dims from 1 up (dim 0 holds the samples), got {reduce_dim!r}")
    return dims


def check_dtype(dtype: Any) -> Optional[torch.dtype]:
    """Return ``dtype`` as a ``torch.dtype`` (a name such as ``"float16"`` too, for YAML), or None.

    Raises:
        TypeError: If it is neither None, a ``torch.dtype`` nor the name of one.
    """
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if dtype is not None and not isinstance(found, torch.dtype):
        raise TypeError(f"`dtype` must be a torch.dtype, its name or None, got {dtype!r} ({type(dtype).__name__}):"
                        " pass e.g. dtype=torch.float16 or dtype='float16'")
    return found


def check_ids_and_version(sample_ids: Any, model_version: Any) -> None:
    """Raise ``TypeError`` unless ``sample_ids`` is None or callable and ``model_version`` None or a str."""
    if sample_ids is not None and not callable(sample_ids):
        raise TypeError(f"`sample_ids` must be a function of the batch or None, got {sample_ids!r}:"
                        " pass e.g. sample_ids=lambda batch: batch['id']")
    if model_version is not None and not isinstance(model_version, str):
        raise TypeError(f"`model_version` must be a str or None, got {model_version!r}: pass e.g. 'v3-epoch12'")
