"""The fault sweep's fourth unseen models (group ``unseen4``, ``benchmarks/_sweep_unseen4.py``).

From ``transformers`` configs (no download): a Phi (parallel attention and MLP from one LayerNorm,
partial rotary), a Falcon (parallel, multi-query), a BLOOM (ALiBi, a LayerNorm on the embedding), a
GPT-BigCode (multi-query attention), a Gemma (RMSNorm with ``1 + w``, the embedding scaled by
sqrt(width), GeGLU) and a DistilBERT and a RoBERTa (post-LayerNorm encoders). Written here: a
WaveNet-like stack of causal dilated 1-D convolutions (gated, with residual and skip branches), a
U-Net-like denoiser (skip concatenations, MSE), an MLP autoencoder (MSE), a mixture-of-experts MLP
with a softmax router, and torch's ``nn.TransformerEncoder`` (post-norm) as a causal LM. Importing
this module adds their recipes to :data:`benchmarks._zoo_models.RECIPES`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from benchmarks._zoo_models import (
    DEPTH,
    LM,
    RECIPES,
    SEQ,
    SWEEP_LMS,
    VOCAB,
    WIDTH,
    Recipe,
    lm_batches,
    regression_batches,
)


def _phi(t: Any) -> nn.Module:
    return t.PhiForCausalLM(t.PhiConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=DEPTH,
        num_attention_heads=4, max_position_embeddings=SEQ, partial_rotary_factor=0.5, resid_pdrop=0.0,
        embd_pdrop=0.0, attention_dropout=0.0, tie_word_embeddings=False))


def _falcon(t: Any) -> nn.Module:
    return t.FalconForCausalLM(t.FalconConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=4, multi_query=True,
        parallel_attn=True, new_decoder_architecture=False, alibi=False, bias=False, hidden_dropout=0.0,
        attention_dropout=0.0, max_position_embeddings=SEQ))


def _bloom(t: Any) -> nn.Module:
    return t.BloomForCausalLM(t.BloomConfig(vocab_size=VOCAB, hidden_size=WIDTH, n_layer=DEPTH, n_head=4,
                                            hidden_dropout=0.0, attention_dropout=0.0))


def _bigcode(t: Any) -> nn.Module:
    return t.GPTBigCodeForCausalLM(t.GPTBigCodeConfig(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=DEPTH, n_head=4, multi_query=True,
        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _gemma(t: Any) -> nn.Module:
    return t.GemmaForCausalLM(t.GemmaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=DEPTH,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=SEQ))


def _distilbert(t: Any) -> nn.Module:
    return t.DistilBertForMaskedLM(t.DistilBertConfig(
        vocab_size=VOCAB, max_position_embeddings=SEQ, dim=WIDTH, n_layers=DEPTH, n_heads=4, hidden_dim=4 * WIDTH,
        dropout=0.0, attention_dropout=0.0))


def _roberta(t: Any) -> nn.Module:
    return t.RobertaForMaskedLM(t.RobertaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=DEPTH,
        num_attention_heads=4, max_position_embeddings=SEQ + 2, pad_token_id=1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


SWEEP_LMS.update(phi=_phi, falcon=_falcon, bloom=_bloom, bigcode=_bigcode, gemma=_gemma, distilbert=_distilbert,
                 roberta=_roberta)


class WaveLayer(nn.Module):
    """A gated causal dilated convolution (tanh x sigmoid), a 1x1 residual branch and a 1x1 skip branch."""

    def __init__(self, width: int, dilation: int) -> None:
        super().__init__()
        self.pad = dilation
        self.conv = nn.Conv1d(width, 2 * width, 2, dilation=dilation)
        self.res, self.skip = nn.Conv1d(width, width, 1), nn.Conv1d(width, width, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        a, b = self.conv(nn.functional.pad(x, (self.pad, 0))).chunk(2, dim=1)
        h = torch.tanh(a) * torch.sigmoid(b)
        return x + self.res(h), self.skip(h)


class WaveNet(nn.Module):
    """A token embedding, a causal first convolution, six dilated layers (1..32), the skips summed, a head."""

    def __init__(self, width: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.first = nn.Conv1d(width, width, 2)
        self.layers = nn.ModuleList(WaveLayer(width, 2 ** i) for i in range(6))
        self.out, self.head = nn.Conv1d(width, width, 1), nn.Conv1d(width, VOCAB, 1)

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding (the zoo's LM data fault scales its output)."""
        return self.embed

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.first(nn.functional.pad(self.embed(tokens).transpose(1, 2), (1, 0)))
        skips = 0
        for layer in self.layers:
            x, s = layer(x)
            skips = skips + s
        return self.head(torch.relu(self.out(torch.relu(skips)))).transpose(1, 2)


class NetLM(nn.Module):
    """A hand-written LM as ``net``, as the zoo's LMs hold theirs."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.net = build()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(tokens)


class EncoderLM(nn.Module):
    """torch's ``nn.TransformerEncoder``, post-norm (``norm_first=False``), causal, learned positions."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, width), nn.Parameter(torch.zeros(1, SEQ, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=False)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding (the zoo's LM data fault scales its output)."""
        return self.embed

    def forward(self, tokens: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(self.embed(tokens) + self.pos, mask=mask, is_causal=True))


def denoise_batches(seed: int, batch: int) -> Callable[[int], tuple[Tensor, Tensor]]:
    """The zoo's noisy 8x8 class images, the clean pattern as the target (MSE)."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 3, 8, 8, generator=g)

    def draw(step: int) -> tuple[Tensor, Tensor]:
        gs = torch.Generator().manual_seed(seed * 100003 + step)
        clean = patterns[torch.randint(0, 10, (batch,), generator=gs)]
        return clean + 0.8 * torch.randn(batch, 3, 8, 8, generator=gs), clean
    return draw


def lowrank_batches(seed: int, batch: int) -> Callable[[int], tuple[Tensor, Tensor]]:
    """16-d points on a curved 4-d manifold plus a little noise, the point itself as the target (an autoencoder)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(4, 16, generator=g) / 2

    def draw(step: int) -> tuple[Tensor, Tensor]:
        gs = torch.Generator().manual_seed(seed * 100003 + step)
        x = torch.tanh(torch.randn(batch, 4, generator=gs) @ mix) + 0.01 * torch.randn(batch, 16, generator=gs)
        return x, x
    return draw


class UNet(nn.Module):
    """A two-level U-Net: the decoder concatenates the encoder's features (skip concatenations), 3 -> 3 channels."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.enc1, self.enc2 = nn.Conv2d(3, width, 3, padding=1), nn.Conv2d(width, 2 * width, 3, padding=1)
        self.mid = nn.Conv2d(2 * width, 2 * width, 3, padding=1)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec = nn.Conv2d(2 * width, width, 3, padding=1)
        self.out = nn.Conv2d(width, 3, 1)

    def forward(self, x: Tensor) -> Tensor:
        e1 = torch.relu(self.enc1(x))
        e2 = torch.relu(self.enc2(nn.functional.max_pool2d(e1, 2)))
        m = torch.relu(self.mid(e2))
        return self.out(torch.relu(self.dec(torch.cat([self.up(m), e1], dim=1))))


def autoencoder() -> nn.Module:
    """16 -> 64 -> 32 -> 4 -> 32 -> 64 -> 16 with GELUs: Linear i is module ``2 * i``."""
    sizes = [16, 64, 32, 4, 32, 64, 16]
    layers: list[nn.Module] = []
    for i in range(6):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), *([nn.GELU()] if i < 5 else [])]
    return nn.Sequential(*layers)


class MoE(nn.Module):
    """A soft mixture of four expert MLPs, weighted by a softmax router."""

    def __init__(self, width: int, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                     for _ in range(experts))

    def forward(self, x: Tensor) -> Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        return x + sum(gate[:, i:i + 1] * expert(x) for i, expert in enumerate(self.experts))


class MoEMLP(nn.Module):
    """An input Linear, three mixture-of-experts layers (``layer(width)``) with LayerNorms between, a head: 16 -> 1."""

    def __init__(self, width: int = 32, layer: Callable[[int], nn.Module] = MoE) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.moe = nn.ModuleList(layer(width) for _ in range(3))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(3))
        self.head = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for moe, norm in zip(self.moe, self.norms):
            x = moe(norm(x))
        return self.head(x)


def _targets(middle: str, linear: str = "") -> dict[str, str]:
    return {**dict.fromkeys(("ramp", "jump", "dead", "nan", "vanish", "lr100"), middle), "data": "",
            **({"vanish": linear, "lr100": linear} if linear else {})}


def _lm(kind: str, middle: str, linear: str, query: str = "") -> Recipe:
    """An LM's recipe; ``query``: the module the ``attn`` fault grows (its queries, or a fused q/k/v projection)."""
    targets = {**_targets(middle, linear), **({"attn": query} if query else {})}
    return Recipe(kind, lambda: LM(kind), lm_batches, "lm", "adamw", 1e-3, 8, targets)


def _recipes() -> dict[str, Recipe]:
    blk = "net.model.layers.2"
    return {
        "phi": _lm("phi", f"{blk}.mlp.fc2", f"{blk}.mlp.fc1", f"{blk}.self_attn.q_proj"),
        "falcon": _lm("falcon", "net.transformer.h.2.mlp.dense_4h_to_h", "net.transformer.h.2.mlp.dense_h_to_4h",
                      "net.transformer.h.2.self_attention.query_key_value"),
        "bloom": _lm("bloom", "net.transformer.h.2.mlp.dense_4h_to_h", "net.transformer.h.2.mlp.dense_h_to_4h"),
        "bigcode": _lm("bigcode", "net.transformer.h.2.mlp.c_proj", "net.transformer.h.2.mlp.c_fc",
                       "net.transformer.h.2.attn.c_attn"),
        "gemma": _lm("gemma", f"{blk}.mlp.down_proj", f"{blk}.mlp.up_proj", f"{blk}.self_attn.q_proj"),
        "distilbert": _lm("distilbert", "net.distilbert.transformer.layer.2.ffn.lin2",
                          "net.distilbert.transformer.layer.2.ffn.lin1"),
        "roberta": _lm("roberta", "net.roberta.encoder.layer.2.output.dense",
                       "net.roberta.encoder.layer.2.intermediate.dense"),
        "wavenet": Recipe("wavenet", lambda: NetLM(WaveNet), lm_batches, "lm", "adam", 3e-3, 8,
                          _targets("net.layers.2.conv")),
        "tfenc": Recipe("tfenc", lambda: NetLM(EncoderLM), lm_batches, "lm", "adamw", 1e-3, 8,
                        _targets("net.encoder.layers.1.linear2", "net.encoder.layers.1.linear1")),
        "unet": Recipe("unet", UNet, denoise_batches, "mse", "adam", 2e-3, 32, _targets("enc2")),
        "autoenc": Recipe("autoenc", autoencoder, lowrank_batches, "mse", "adam", 2e-3, 32, _targets("4")),
        "moe": Recipe("moe", MoEMLP, regression_batches, "mse", "adam", 1e-3, 32,
                      _targets("moe.1.experts.2.2", "moe.1.experts.2.0")),
    }


RECIPES.update(_recipes())
