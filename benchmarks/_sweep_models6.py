"""The fault sweep's sixth unseen models (group ``unseen6``, ``benchmarks/_sweep_unseen6.py``).

From ``transformers`` configs (no download): a T5 and a BART encoder-decoder (T5: relative position
bias, RMS LayerNorm, pre-norm; BART: learned positions, post-LayerNorm; the decoder's cross-attention
reading the encoder's output) trained to continue the zoo's token sequences from their reversal (a
seq2seq LM loss), a Mistral (sliding-window
attention, grouped-query), a Mixtral (transformers' own sparse top-2 MoE, its experts fused in one
module), a Mamba (selective state-space blocks, the pure-PyTorch path), a StableLM (LayerNorm,
partial rotary) and a Cohere (parallel attention and MLP, LayerNorm without bias, scaled logits).
Written here: a MobileNet-like CNN (inverted residuals, depthwise convolutions, squeeze-and-
excitation gating), a DenseNet-like CNN (each layer reads every earlier layer's features,
concatenated) and a message-passing network on small synthetic graphs. Importing this module adds
their recipes to :data:`benchmarks._zoo_models.RECIPES`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from benchmarks._sweep_models4 import _lm, _targets
from benchmarks._zoo_models import LM, RECIPES, SEQ, SWEEP_LMS, VOCAB, WIDTH, Recipe, image_batches, lm_batches

LAYERS = 4  # the new LMs' depth: the fault in block 1 or 2 leaves blocks on either side


def _t5(t: Any) -> nn.Module:
    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=16, d_ff=4 * WIDTH, num_layers=3, num_decoder_layers=3, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def _bart(t: Any) -> nn.Module:
    return t.BartForConditionalGeneration(t.BartConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=4 * WIDTH, decoder_ffn_dim=4 * WIDTH, max_position_embeddings=SEQ,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2))


def _mistral(t: Any) -> nn.Module:
    return t.MistralForCausalLM(t.MistralConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, sliding_window=8,
        tie_word_embeddings=False))


def _mixtral(t: Any) -> nn.Module:
    return t.MixtralForCausalLM(t.MixtralConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, num_local_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False))


def _mamba(t: Any) -> nn.Module:
    return t.MambaForCausalLM(t.MambaConfig(vocab_size=VOCAB, hidden_size=WIDTH, state_size=8,
                                            num_hidden_layers=LAYERS, expand=2, conv_kernel=4))


def _stablelm(t: Any) -> nn.Module:
    return t.StableLmForCausalLM(t.StableLmConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ, partial_rotary_factor=0.25,
        hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False))


def _cohere(t: Any) -> nn.Module:
    return t.CohereForCausalLM(t.CohereConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ, logit_scale=0.25,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


SWEEP_LMS.update(t5=_t5, bart=_bart, mistral=_mistral, mixtral=_mixtral, mamba=_mamba, stablelm=_stablelm,
                 cohere=_cohere)


class Seq2SeqLM(LM):
    """An encoder-decoder that reads the sequence reversed and writes it forward (teacher-forced): its logits."""

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(input_ids=tokens.flip(1), decoder_input_ids=tokens).logits


class Inverted(nn.Module):
    """MobileNetV2/V3's inverted residual: 1x1 expand, 3x3 depthwise, squeeze-and-excitation, 1x1 project, add."""

    def __init__(self, width: int, expand: int = 4) -> None:
        super().__init__()
        wide = width * expand
        self.expand = nn.Sequential(nn.Conv2d(width, wide, 1, bias=False), nn.BatchNorm2d(wide), nn.ReLU6())
        self.dw = nn.Conv2d(wide, wide, 3, padding=1, groups=wide, bias=False)
        self.dw_bn, self.dw_act = nn.BatchNorm2d(wide), nn.ReLU6()
        self.se = nn.Sequential(nn.Linear(wide, wide // 4), nn.ReLU(), nn.Linear(wide // 4, wide), nn.Hardsigmoid())
        self.project = nn.Sequential(nn.Conv2d(wide, width, 1, bias=False), nn.BatchNorm2d(width))

    def forward(self, x: Tensor) -> Tensor:
        h = self.dw_act(self.dw_bn(self.dw(self.expand(x))))
        h = h * self.se(h.mean(dim=(2, 3)))[:, :, None, None]  # the channels gated by their squeezed means
        return x + self.project(h)


class MobileNet(nn.Module):
    """A stem, four inverted residual blocks with squeeze-and-excitation, a pooled linear head: 8x8 images."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU6())
        self.blocks = nn.Sequential(*(Inverted(width) for _ in range(4)))
        self.head = nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class DenseLayer(nn.Module):
    """BatchNorm, ReLU, a 3x3 convolution adding ``growth`` channels: its output is concatenated to its input."""

    def __init__(self, width: int, growth: int) -> None:
        super().__init__()
        self.bn, self.relu = nn.BatchNorm2d(width), nn.ReLU()
        self.conv = nn.Conv2d(width, growth, 3, padding=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x, self.conv(self.relu(self.bn(x)))], dim=1)


class DenseNet(nn.Module):
    """A stem, two dense blocks of four layers with a transition (1x1 convolution, pooling) between, a head."""

    def __init__(self, width: int = 16, growth: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.block1 = nn.Sequential(*(DenseLayer(width + i * growth, growth) for i in range(4)))
        wide = width + 4 * growth
        self.transition = nn.Sequential(nn.BatchNorm2d(wide), nn.ReLU(), nn.Conv2d(wide, width, 1, bias=False),
                                        nn.AvgPool2d(2))
        self.block2 = nn.Sequential(*(DenseLayer(width + i * growth, growth) for i in range(4)))
        self.norm, self.head = nn.BatchNorm2d(wide), nn.Linear(wide, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = self.block2(self.transition(self.block1(self.stem(x))))
        return self.head(torch.relu(self.norm(x)).mean(dim=(2, 3)))


NODES, FEATURES = 8, 8


def graph_batches(seed: int, batch: int) -> Callable[[int], tuple[Tensor, Tensor]]:
    """Random graphs of 8 nodes (edges drawn at p=0.3, self-loops, mean-normalised), a teacher's graph-level target.

    Each row packs the adjacency and the node features: ``(batch, 8, 8 + 8)``.
    """
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(FEATURES, 16, generator=g) / 3, torch.randn(16, 1, generator=g) / 4

    def draw(step: int) -> tuple[Tensor, Tensor]:
        gs = torch.Generator().manual_seed(seed * 100003 + step)
        edges = (torch.rand(batch, NODES, NODES, generator=gs) < 0.3).float()
        adj = ((edges + edges.transpose(1, 2)) > 0).float() + torch.eye(NODES)
        adj = adj / adj.sum(-1, keepdim=True)
        feats = torch.randn(batch, NODES, FEATURES, generator=gs)
        y = (torch.tanh(adj @ adj @ feats @ w1) @ w2).mean(dim=1)
        return torch.cat([adj, feats], dim=-1), y + 0.01 * torch.randn(batch, 1, generator=gs)
    return draw


class MessagePassing(nn.Module):
    """A graph layer: each node's message (a Linear of its state) averaged over its neighbours, an update MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.message, self.update = nn.Linear(width, width), nn.Linear(2 * width, width)
        self.act = nn.GELU()

    def forward(self, adj: Tensor, h: Tensor) -> Tensor:
        return h + self.act(self.update(torch.cat([h, adj @ self.message(h)], dim=-1)))


class GNN(nn.Module):
    """A node encoder, four message-passing layers with LayerNorms, a mean readout and a head: a graph -> 1."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.encode = nn.Linear(FEATURES, width)
        self.layers = nn.ModuleList(MessagePassing(width) for _ in range(4))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(4))
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        adj, h = x[..., :NODES], self.encode(x[..., NODES:])
        for layer, norm in zip(self.layers, self.norms):
            h = layer(adj, norm(h))
        return self.head(h.mean(dim=1))


def _recipes() -> dict[str, Recipe]:
    blk = "net.model.layers.2"
    return {
        "t5": Recipe("t5", lambda: Seq2SeqLM("t5"), lm_batches, "lm", "adamw", 1e-3, 8,
                     _targets("net.decoder.block.1.layer.1.EncDecAttention.o")),  # the decoder's cross-attention
        "bart": Recipe("bart", lambda: Seq2SeqLM("bart"), lm_batches, "lm", "adamw", 1e-3, 8,
                       _targets("net.model.decoder.layers.1.encoder_attn.out_proj")),
        "mistral": _lm("mistral", f"{blk}.mlp.down_proj", f"{blk}.mlp.up_proj", f"{blk}.self_attn.q_proj"),
        "mixtral": _lm("mixtral", "net.model.layers.1.mlp.experts", "net.model.layers.1.mlp.experts"),
        "mamba": _lm("mamba", "net.backbone.layers.1.mixer.out_proj", "net.backbone.layers.1.mixer.in_proj"),
        "stablelm": _lm("stablelm", f"{blk}.mlp.down_proj", f"{blk}.mlp.up_proj", f"{blk}.self_attn.q_proj"),
        "cohere": _lm("cohere", f"{blk}.mlp.down_proj", f"{blk}.mlp.up_proj", f"{blk}.self_attn.q_proj"),
        "mobilenet": Recipe("mobilenet", MobileNet, image_batches, "ce", "sgd", 0.05, 32, _targets("blocks.1.dw")),
        "densenet": Recipe("densenet", DenseNet, image_batches, "ce", "sgd", 0.05, 32, _targets("block1.2.conv")),
        "gnn": Recipe("gnn", GNN, graph_batches, "mse", "adam", 1e-3, 32,
                      _targets("layers.1.update", "layers.1.message")),
    }


RECIPES.update(_recipes())
