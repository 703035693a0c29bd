"""Where the attention figures find ``q`` and ``k``: three kinds of attention module, read on a logged step.

- ``"mha"``: ``nn.MultiheadAttention``. Its inputs (seen by a forward pre-hook) are projected
  again with its ``in_proj`` weights (or ``q_proj_weight``/``k_proj_weight``), for the sampled
  sequences only: one extra projection of their queries and keys. ``attn_mask``, ``key_padding_mask`` and ``is_causal``
  are honoured; the extra key of ``add_bias_kv``/``add_zero_attn`` is left out.
- ``"gpt2"``: Hugging Face GPT-2-style self-attention (a module with ``c_attn``, ``num_heads``,
  ``head_dim`` and ``split_size``, not cross-attention): the output of its ``c_attn`` projection,
  seen by a forward hook, split into ``q, k, v``; causal, with the module's own ``scaling``.
  A padding ``attention_mask`` is not seen, so padded keys count as keys.
- ``"sdpa"``: any other module, which must call ``F.scaled_dot_product_attention`` inside its
  forward: on a logged step a :class:`SdpaCapture` (a ``TorchFunctionMode``) is entered for the
  module's forward and reads each call's ``q``, ``k``, ``attn_mask``, ``is_causal``, ``scale``
  and ``enable_gqa`` exactly as the kernel gets them (Hugging Face models with
  ``attn_implementation="sdpa"`` too: on GPT-2 it gives the figures of the ``"gpt2"`` read).
  While it is entered every torch call in that forward goes through Python (a few microseconds
  each); under ``torch.compile`` it is not entered.

Every read runs under ``torch.no_grad()``: nothing is added to the training step's autograd graph.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_hooks.measure._attention import Sample, attention_row, spread

Kind = Literal["mha", "gpt2", "sdpa"]

_MHA_FORWARD = inspect.signature(nn.MultiheadAttention.forward)
_SDPA = inspect.signature(lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False: None)


def is_attention(module: nn.Module) -> bool:
    """Whether the default selection takes ``module``: an ``nn.MultiheadAttention``, or a class named ``*Attention``."""
    return isinstance(module, nn.MultiheadAttention) or type(module).__name__.endswith("Attention")


def kind_of(module: nn.Module) -> Kind:
    """How ``q`` and ``k`` are read from ``module`` (see the module docstring)."""
    if isinstance(module, nn.MultiheadAttention):
        return "mha"
    gpt2 = all(hasattr(module, a) for a in ("c_attn", "num_heads", "head_dim", "split_size"))
    return "gpt2" if gpt2 and not getattr(module, "is_cross_attention", False) else "sdpa"


@torch.no_grad()
def mha_row(module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any], sample: Sample) -> Tensor:
    """The attention row of one ``nn.MultiheadAttention`` call, from the arguments it was given.

    Only the sampled sequences of the batch (``sample.sequences``, evenly spread) are projected
    again, under ``torch.no_grad()``: no autograd graph, and no copy of the whole batch.
    """
    given = _MHA_FORWARD.bind(module, *args, **kwargs)
    given.apply_defaults()
    a = given.arguments
    query, key = a["query"], a["key"]
    if query.dim() == 2:  # unbatched
        query, key = query.unsqueeze(1 - module.batch_first), key.unsqueeze(1 - module.batch_first)
    if not module.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    heads, dim = module.num_heads, module.head_dim
    batch, length, keys = query.shape[0], query.shape[1], key.shape[1]
    b = spread(batch, sample.sequences, query.device)
    if module._qkv_same_embed_dim:
        w_q, w_k, _ = module.in_proj_weight.chunk(3)
    else:
        w_q, w_k = module.q_proj_weight, module.k_proj_weight
    b_q, b_k = (None, None) if module.in_proj_bias is None else module.in_proj_bias.chunk(3)[:2]
    q = F.linear(query[b], w_q, b_q).unflatten(-1, (heads, dim)).transpose(1, 2)
    k = F.linear(key[b], w_k, b_k).unflatten(-1, (heads, dim)).transpose(1, 2)
    allowed, bias = _mha_masks(a["attn_mask"], a["key_padding_mask"], b, batch, heads, length, keys)
    causal = bool(a["is_causal"]) and a["attn_mask"] is None
    return attention_row(q, k, causal=causal, allowed=allowed, bias=bias, sample=sample)


def _mha_masks(attn_mask: Optional[Tensor], padding: Optional[Tensor], b: Tensor, batch: int, heads: int,
               length: int, keys: int) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """MHA's masks (bool: True means *not* allowed; float: added) as ``attention_row``'s ``allowed`` and ``bias``.

    Per-sequence masks are cut to the sampled sequences ``b`` of the ``batch``.
    """
    allowed: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    for mask in (attn_mask, padding):
        if mask is None:
            continue
        if mask is padding:
            mask = mask.reshape(batch, 1, 1, keys)[b]
        elif mask.dim() == 3:
            mask = mask.reshape(batch, heads, length, keys)[b]
        if mask.dtype == torch.bool:
            allowed = ~mask if allowed is None else allowed & ~mask
        else:
            bias = mask if bias is None else bias + mask
    return allowed, bias


@torch.no_grad()
def gpt2_row(module: Any, qkv: Tensor, sample: Sample) -> Tensor:
    """The attention row of one GPT-2-style self-attention call, from its ``c_attn`` output ``(batch, length, 3E)``."""
    q, k, _ = qkv.split(module.split_size, dim=-1)
    q, k = (z.unflatten(-1, (module.num_heads, module.head_dim)).transpose(1, 2) for z in (q, k))
    scale = float(getattr(module, "scaling", module.head_dim ** -0.5))
    return attention_row(q, k, scale=scale, causal=True, sample=sample)


@torch.no_grad()
def sdpa_row(args: tuple[Any, ...], kwargs: dict[str, Any], sample: Sample) -> Tensor:
    """The attention row of one ``F.scaled_dot_product_attention`` call, from its arguments."""
    given = _SDPA.bind(*args, **kwargs)
    given.apply_defaults()
    a = given.arguments
    mask = a["attn_mask"]
    is_bool = mask is not None and mask.dtype == torch.bool
    return attention_row(a["query"], a["key"], scale=a["scale"], causal=bool(a["is_causal"]),
                         allowed=mask if is_bool else None, bias=None if is_bool else mask, sample=sample)


class SdpaCapture(TorchFunctionMode):
    """While entered, hands each ``F.scaled_dot_product_attention`` call's arguments to ``seen``, then runs it.

    ``seen`` runs with this mode off, so its own torch calls are not intercepted.
    """

    def __init__(self, seen: Callable[[tuple[Any, ...], dict[str, Any]], None]) -> None:
        super().__init__()
        self._seen = seen

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self._seen(args, kwargs)
        return func(*args, **kwargs)
