"""TransformerStability's targets, hooks and figures: which modules it reads, the hooks that read them, what it logs."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, Optional, Union, cast

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hooks.core._torch_internals import in_backward
from lightning_hooks.core.selection import ModuleSelection, select_modules, validate_selection
from lightning_hooks.measure._attention import Sample, logit_row, massive_row
from lightning_hooks.measure._attention_sources import SdpaCapture, gpt2_row, is_attention, kind_of, mha_row, sdpa_row
from lightning_hooks.output.figures import ScalarBlock

Selection = Union[ModuleSelection, bool]
"""A module selection, or False to turn a signal off."""

#: The name the model's own output is logged under, when it is read as the output logits.
OUTPUT = "output"

#: Each signal's two logged stats: its peak (max over the step) and its mean.
STATS = {"attention": ("attention_max_logit", "attention_entropy"),
         "logits": ("logit_abs_max", "logit_lse"),
         "blocks": ("massive_ratio", "kurtosis")}


def validate_signal(argument: str, value: Any) -> None:
    """Check a selection argument: False (off), None (the default) or a module selection."""
    if value is True:
        raise ValueError(f"`{argument}` must be None (the default), False (off) or a module selection, got True")
    if value is not False:
        try:
            validate_selection(value)
        except (TypeError, ValueError) as err:
            raise type(err)(str(err).replace("`modules`", f"`{argument}`")) from None


def resolve(model: nn.Module, attention: Selection, logits: Selection,
            blocks: Selection) -> dict[str, list[tuple[str, nn.Module]]]:
    """The modules each signal reads, by signal (``"attention"``, ``"logits"``, ``"blocks"``).

    Defaults: attention, every ``nn.MultiheadAttention`` and every other module whose class is
    named ``*Attention`` and holds none (the outermost of nested ones); logits, the modules named ``lm_head``, else the
    model's own output; blocks, each attention module's nearest enclosing numbered module (the
    ``h.3`` of ``h.3.attn``: an entry of a ``ModuleList`` or ``Sequential``).
    """
    found: dict[str, list[tuple[str, nn.Module]]] = {"attention": [], "logits": [], "blocks": []}
    if attention is None:  # an nn.MultiheadAttention rather than the module around it
        named = [(n, m) for n, m in model.named_modules() if n and is_attention(m)]
        inner = {n for n, m in named if isinstance(m, nn.MultiheadAttention)}
        found["attention"] = _outermost([(n, m) for n, m in named
                                         if n in inner or not any(i.startswith(n + ".") for i in inner)])
    elif attention is not False:
        found["attention"] = select_modules(model, cast(ModuleSelection, attention), "attention")
    if logits is None:
        heads = [(n, m) for n, m in model.named_modules() if n.rpartition(".")[2] == "lm_head"]
        found["logits"] = heads or [(OUTPUT, model)]
    elif logits is not False:
        found["logits"] = select_modules(model, cast(ModuleSelection, logits), "logits")
    if blocks is None:
        modules = dict(model.named_modules())
        names = dict.fromkeys(_block_of(n) for n, _ in found["attention"])
        found["blocks"] = [(n, modules[n]) for n in names if n in modules]
    elif blocks is not False:
        found["blocks"] = select_modules(model, cast(ModuleSelection, blocks), "blocks")
    return found


def _outermost(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    names = [n for n, _ in named]
    return [(n, m) for n, m in named if not any(n.startswith(other + ".") for other in names)]


def _block_of(name: str) -> str:
    """The nearest numbered module at or above ``name`` (``h.3`` for ``h.3.attn``), else its parent."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if re.fullmatch(r"\d+", parts[end - 1]):
            return ".".join(parts[:end])
    return name.rpartition(".")[0] or name


def first_tensor(output: Any) -> Optional[Tensor]:
    """The tensor a module returned: itself, a ``.logits`` attribute, or the first of a tuple or list."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    return None


Add = Callable[[int, Tensor], None]
"""Keeps one row of figures for the target of this index."""
Guard = Callable[[str, Callable[..., Any]], Callable[..., Any]]


def register(index: int, signal: str, name: str, module: nn.Module, add: Add, guard: Guard,
             sample: Sample) -> list[RemovableHandle]:
    """Register the hooks that read ``signal`` from ``module``, each adding its rows under ``index``."""
    if signal == "logits":
        def on_logits(mod: nn.Module, args: Any, output: Any) -> None:
            x = first_tensor(output)
            if x is not None and x.is_floating_point() and x.dim() >= 1 and not in_backward():
                add(index, logit_row(x, sample))
        return [module.register_forward_hook(guard(name, on_logits))]
    if signal == "blocks":
        def on_block(mod: nn.Module, args: Any, output: Any) -> None:
            x = first_tensor(output)
            if x is not None and x.is_floating_point() and x.numel() and not in_backward():
                add(index, massive_row(x, sample))
        return [module.register_forward_hook(guard(name, on_block))]
    return _register_attention(index, name, module, add, guard, sample)


def _register_attention(index: int, name: str, module: nn.Module, add: Add, guard: Guard,
                        sample: Sample) -> list[RemovableHandle]:
    kind = kind_of(module)
    if kind == "mha":
        def on_mha(mod: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not in_backward():
                add(index, mha_row(mod, args, kwargs, sample))
        return [module.register_forward_pre_hook(guard(name, on_mha), with_kwargs=True)]
    if kind == "gpt2":
        def on_qkv(mod: nn.Module, args: Any, output: Tensor) -> None:
            if not in_backward():
                add(index, gpt2_row(module, output, sample))
        projection = module.get_submodule("c_attn")
        return [projection.register_forward_hook(guard(name, on_qkv))]
    capture = SdpaCapture(guard(name, lambda args, kwargs: add(index, sdpa_row(args, kwargs, sample))))
    entered: list[bool] = []

    def enter(mod: nn.Module, args: Any) -> None:
        if not in_backward() and not torch.compiler.is_compiling():
            capture.__enter__()
            entered.append(True)

    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        if entered:  # always called, even when the forward raised: the mode never stays entered
            entered.pop()
            capture.__exit__(None, None, None)

    return [module.register_forward_pre_hook(guard(name, enter)),
            module.register_forward_hook(leave, always_call=True)]


def warn_no_attention(logits: list[str]) -> None:
    """Warn, before training, that the default selection found no attention module: little is left to read."""
    rank_zero_warn(
        "TransformerStability: no attention module in the model (no nn.MultiheadAttention, no class named"
        f" *Attention): it reads only the output logits of {logits}, and no attention logit, entropy or block."
        " Name the modules that compute attention with `attention=`; for a model without attention (a CNN, an"
        " MLP) ActivationMonitor and LayerHealth are the callbacks that watch it.")


def figures(targets: list[tuple[str, str]], values: np.ndarray) -> list[ScalarBlock]:
    """The step's figures from its rows ``(peak, total, count)``: the peak's max, and ``total / count``, per target.

    One typed block per statistic (``activations`` kind), rows in the order the targets first appear.
    An undefined figure is left out: a NaN peak (a call's max ignores it; a target whose every
    peak is NaN has no peak figure), and a mean with a count of 0 or a NaN total.
    """
    peaks: dict[tuple[str, str], float] = {}
    sums: dict[tuple[str, str], list[float]] = {}
    for key, (peak, total, count) in zip(targets, values.tolist()):
        if not math.isnan(peak):
            peaks[key] = max(peaks.get(key, -math.inf), peak)
        acc = sums.setdefault(key, [0.0, 0.0])
        acc[0], acc[1] = acc[0] + total, acc[1] + count
    columns: dict[str, tuple[list[str], list[float]]] = {}
    for (signal, name), (total, count) in sums.items():
        high, mean = STATS[signal]
        for stat, value in ((high, peaks.get((signal, name), math.nan)), (mean, total / count if count else math.nan)):
            if not math.isnan(value):
                rows, vals = columns.setdefault(stat, ([], []))
                rows.append(name)
                vals.append(value)
    return [ScalarBlock("activations", stat, rows, vals, [f"activations/{name}/{stat}" for name in rows])
            for stat, (rows, vals) in columns.items()]
