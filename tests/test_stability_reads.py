"""TransformerStability's reads: nothing added to the autograd graph, the sampled sequences only, no made-up figures."""

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_hooks import TransformerStability
from lightning_hooks.callbacks._stability_hooks import register, resolve
from lightning_hooks.measure._attention import Sample, massive_row
from lightning_hooks.measure._attention_sources import mha_row
from tests.test_stability import ALL, Block, Decoder, MhaAttention, SdpaAttention, fit, token_loader


def saved_tensors_of_a_training_forward(model: nn.Module, ids: torch.Tensor) -> int:
    """How many tensors autograd saves for backward during one forward with grad enabled."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids).sum().backward()
    return len(saved)


@pytest.mark.parametrize("attention", [MhaAttention, SdpaAttention])
def test_the_reads_add_nothing_to_the_autograd_graph_of_the_training_forward(attention):
    model = Decoder(attention)
    ids = next(iter(token_loader()))[0]
    without = saved_tensors_of_a_training_forward(model, ids)
    rows: list[torch.Tensor] = []
    found = resolve(model, None, None, None)
    handles = [handle for signal, targets in found.items() for index, (name, module) in enumerate(targets)
               for handle in register(index, signal, name, module, lambda i, row: rows.append(row),
                                      lambda name, hook: hook, Sample())]
    with_reads = saved_tensors_of_a_training_forward(model, ids)
    for handle in handles:
        handle.remove()
    assert len(rows) == 5  # 2 attention modules, the head, 2 blocks
    assert with_reads == without
    assert not any(row.requires_grad or row.grad_fn is not None for row in rows)


def mha_inputs(batch: int) -> tuple[nn.MultiheadAttention, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MHA (batch first) and its input, a boolean padding mask and a float mask per sequence and head."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(batch, 6, 16, generator=gen) * 2
    padding = torch.zeros(batch, 6, dtype=torch.bool)
    padding[:, 4:] = torch.arange(batch)[:, None] % 2 == 1  # odd sequences: their last two keys are padding
    bias = torch.randn(batch * 4, 6, 6, generator=gen)
    return mha, x, padding, bias


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
def test_mha_reads_the_sampled_sequences_with_their_own_masks_as_its_probabilities_say():
    mha, x, padding, bias = mha_inputs(5)
    row = mha_row(mha, (x, x, x), {"key_padding_mask": padding, "attn_mask": bias}, Sample(2, 4, 6))
    with torch.no_grad():
        _, probs = mha(x, x, x, key_padding_mask=padding, attn_mask=bias, average_attn_weights=False)
        w_q, w_k, _ = mha.in_proj_weight.chunk(3)
        b_q, b_k, _ = mha.in_proj_bias.chunk(3)
        q = (x @ w_q.T + b_q).unflatten(-1, (4, 4)).transpose(1, 2)
        k = (x @ w_k.T + b_k).unflatten(-1, (4, 4)).transpose(1, 2)
    sampled = [0, 4]  # 2 of 5 sequences, evenly spread
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)[sampled]
    logits = (q @ k.transpose(-1, -2) / 2).masked_fill(padding[:, None, None, :], -math.inf)[sampled]
    peak, total, count = row.tolist()
    assert count == 2 * 4 * 6
    assert total / count == pytest.approx(entropy.mean().item(), rel=1e-5)
    assert peak == pytest.approx(logits.max().item(), rel=1e-5)


def test_mha_projects_only_the_sampled_sequences_whatever_the_batch():
    flops = {}
    for batch in (2, 64):
        mha, x, padding, bias = mha_inputs(batch)
        with FlopCounterMode(display=False) as counter:
            mha_row(mha, (x, x, x), {"key_padding_mask": padding, "attn_mask": bias}, Sample(2, 4, 6))
        flops[batch] = counter.get_total_flops()
    assert flops[64] == flops[2] > 0


def test_a_massive_ratio_or_kurtosis_that_is_undefined_is_nan_or_not_counted():
    sparse = F.relu(torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0)) - 1.0)  # most values 0
    ratio, kurtosis, count = massive_row(sparse).tolist()
    assert math.isnan(ratio) and count == 1 and math.isfinite(kurtosis)
    assert massive_row(torch.full((4, 16), 3.0)).tolist() == [1.0, 0.0, 0.0]  # constant: no kurtosis
    nonfinite = torch.ones(4, 16)
    nonfinite[0, 0] = math.inf
    assert math.isnan(massive_row(nonfinite)[0].item())


class SparseBlock(Block):
    """A block whose output is mostly exact zeros (a ReLU past a threshold): its median |x| is 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(super().forward(x) - 1.0)


class SparseDecoder(Decoder):
    def __init__(self) -> None:
        super().__init__(SdpaAttention)
        self.h = nn.ModuleList(SparseBlock(SdpaAttention) for _ in range(2))


def test_a_sparse_block_gets_no_massive_ratio_and_no_massive_verdict_but_its_kurtosis(tmp_path: Any):
    stability = TransformerStability(**ALL)
    acc = fit(tmp_path, SparseDecoder(), stability)
    tags = acc.Tags()["scalars"]
    assert "activations/h.0/massive_ratio" not in tags and "activations/h.1/massive_ratio" not in tags
    assert all(math.isfinite(e.value) for e in acc.Scalars("activations/h.0/kurtosis"))
    assert "activations/h.0.attn/attention_entropy" in tags
    assert not any(problem == "massive" for problem, _ in stability.verdicts.episodes)
    assert "massive" not in stability.diagnosis()
