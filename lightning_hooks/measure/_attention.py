"""Transformer stability figures (pure tensor functions): attention logits and entropy, output logits, outliers.

Each function returns one row of three float32 numbers on the tensor's own device, in the
form ``(peak, total, count)``: the row's figure is ``peak`` (reduced by max over calls) and
``total / count`` (a mean, summed over calls). Nothing leaves the device here.

- :func:`attention_row`: ``(max attention logit, sum of entropies, queries)``, recomputing
  ``q·k`` for a sample of sequences, heads and query positions (see :class:`Sample` for the cost).
- :func:`logit_row`: ``(max |logit|, sum of log-sum-exps, rows)``; the log-sum-exp is the
  quantity z-loss penalises (PaLM's ``1e-4 * log(Z)^2``).
- :func:`massive_row`: ``(max|x| / median|x|, kurtosis, 1)`` of a hidden state.

Each runs under ``torch.no_grad()``: a hook that calls it on a training forward adds
nothing to the autograd graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_hooks.measure._tensor_values import as_stored


@dataclass(frozen=True)
class Sample:
    """How much of an attention call, or of a tensor, is read on a logged step.

    The attention figures recompute ``softmax(q·kᵀ·scale)`` for ``sequences x heads x queries``
    query rows against every key: ``2 * sequences * heads * queries * keys * head_dim`` flops
    and a float32 ``sequences x heads x queries x keys`` buffer per attention call (with the
    defaults, 2 x 8 x 32 rows: 4 MiB for 2048 keys), where the layer's own forward costs
    ``4 * batch * heads * length * keys * head_dim``. Output logits: ``rows`` rows of the
    logits for the log-sum-exp (the max is over every logit); massive activations: at most
    ``elements`` values for the median and kurtosis (the max is over every value).
    """

    sequences: int = 2
    heads: int = 8
    queries: int = 32
    rows: int = 1024
    elements: int = 1 << 20


def spread(n: int, k: int, device: torch.device) -> Tensor:
    """At most ``k`` indices in ``range(n)``, evenly spread, first and last included."""
    if n <= k:
        return torch.arange(n, device=device)
    return torch.linspace(0, n - 1, k, device=device).round().long()


@torch.no_grad()
def attention_row(q: Tensor, k: Tensor, *, scale: Optional[float] = None, causal: bool = False,
                  allowed: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                  sample: Sample = Sample()) -> Tensor:
    """``(max attention logit, sum of attention entropies, queries)`` of one attention call, on a sample.

    Args:
        q: Queries, ``(batch, heads, length, head_dim)``.
        k: Keys, ``(batch, kv_heads, keys, head_dim)``; ``kv_heads`` divides ``heads`` (grouped queries).
        scale: The factor on ``q·k`` (None: ``1 / sqrt(head_dim)``, as SDPA).
        causal: Query ``i`` sees keys ``0..i`` (SDPA's ``is_causal``, top-left aligned).
        allowed: A boolean mask broadcastable to ``(batch, heads, length, keys)``, True where a
            query may attend.
        bias: A float mask broadcastable like ``allowed``, added to the logits before the
            softmax (``-inf`` masks). It counts for the entropy, not for the max logit, which is
            the ``q·k·scale`` that QK-norm bounds.
        sample: How many sequences, heads and query positions are read (evenly spread).

    Returns:
        A float32 row on ``q``'s device. Query rows that may see fewer than two keys have an
        entropy of 0 by construction and are left out of the sum and the count.
    """
    batch, heads, length, dim = q.shape
    keys, device = k.shape[-2], q.device
    b, h, i = (spread(n, m, device) for n, m in ((batch, sample.sequences), (heads, sample.heads),
                                                   (length, sample.queries)))
    scale = dim ** -0.5 if scale is None else scale
    qs = q.detach()[b][:, h][:, :, i].float()
    ks = k.detach()[b][:, h // (heads // k.shape[-3])].float()
    logits = qs @ ks.transpose(-1, -2) * scale  # (b, h, i, keys)
    ok = torch.ones_like(logits, dtype=torch.bool)
    if causal:
        ok = ok & (torch.arange(keys, device=device) <= i[:, None])
    full = (batch, heads, length, keys)
    if allowed is not None:
        ok = ok & allowed.expand(full)[b][:, h][:, :, i]
    scores = logits if bias is None else logits + bias.expand(full)[b][:, h][:, :, i].float()
    ok = ok & (scores > -math.inf)
    log_p = scores.masked_fill(~ok, -math.inf).log_softmax(-1)
    entropy = -(log_p.exp() * log_p.masked_fill(~ok, 0.0)).sum(-1)
    counted = ok.sum(-1) >= 2
    peak = logits.masked_fill(~ok, -math.inf).amax()
    return torch.stack([peak, torch.where(counted, entropy, 0.0).sum(), counted.sum().float()])


@torch.no_grad()
def logit_row(logits: Tensor, sample: Sample = Sample()) -> Tensor:
    """``(max |logit|, sum of log-sum-exps, rows)``: the max over every logit, log-sum-exps of ``sample.rows`` rows."""
    x = as_stored(logits.detach())
    peak = torch.maximum(x.amax(), -x.amin()).float()
    rows = x.reshape(-1, x.shape[-1])
    rows = rows[spread(rows.shape[0], sample.rows, x.device)].float()
    return torch.stack([peak, torch.logsumexp(rows, -1).sum(), peak.new_full((), float(rows.shape[0]))])


@torch.no_grad()
def massive_row(hidden: Tensor, sample: Sample = Sample()) -> Tensor:
    """``(max|x| / median|x|, kurtosis, 1)`` of a hidden state (Sun et al. 2024's massive activations).

    The max is over every value; the median and the kurtosis (``E[(x-m)^4] / var^2``: 3 for a
    Gaussian) over at most ``sample.elements`` of them, evenly strided. Where one is undefined
    it is left out, not made up: the ratio is NaN where the median ``|x|`` is 0 (half the values
    or more exactly 0, as in a sparse or ReLU output, where it would be infinite) or the max is
    not finite (non-finite outputs, which the non-finite counts report), and the kurtosis of
    values with no variance gets a count of 0 (left out of the mean).
    """
    x = as_stored(hidden.detach())
    peak = torch.maximum(x.amax(), -x.amin()).float()
    flat = x.reshape(-1)
    flat = flat[:: max(1, flat.numel() // sample.elements)].float()
    median = flat.abs().median()
    centred = flat - flat.mean()
    var = centred.square().mean()
    defined = var > 0
    kurtosis = torch.where(defined, centred.square().square().mean() / var.square(), 0.0)
    ratio = torch.where((median > 0) & peak.isfinite(), peak / median, math.nan)
    return torch.stack([ratio, kurtosis, defined.float()])
