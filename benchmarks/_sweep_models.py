"""The fault sweep's models: shapes the fault zoo does not hold (``benchmarks/fault_sweep.py``).

A BERT (post-LayerNorm encoder) and a GPT-NeoX (parallel residual) from ``transformers`` configs,
a deeper MLP with LayerNorm and GELU, the zoo's CNN with GroupNorm instead of BatchNorm, a small
hand-written ViT and a stack of GRUs (their outputs are tuples: ``(output, state)``). Importing
this module adds their recipes to :data:`benchmarks._zoo_models.RECIPES`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from benchmarks._zoo_models import CNN, LM, RECIPES, VOCAB, WIDTH, Recipe, image_batches, lm_batches, regression_batches


def deep_mlp(depth: int = 10, width: int = 64) -> nn.Module:
    """``depth`` blocks of Linear, LayerNorm and GELU, 16 -> 1: module ``3 * i`` is the i-th Linear."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(16 if i == 0 else width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


class ViTBlock(nn.Module):
    """A pre-LayerNorm transformer block, written out: attention from one qkv Linear, then an MLP."""

    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ln2, self.fc1, self.act, self.fc2 = (nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                                  nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attn)
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    """2x2 patches of an 8x8 image (16 tokens), learned positions, four blocks, a LayerNorm and a head."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, width, 2, stride=2)
        self.pos = nn.Parameter(torch.zeros(1, 16, width))
        self.blocks = nn.Sequential(*(ViTBlock(width) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.blocks(tokens)).mean(1))


class GRUStack(nn.Module):
    """An embedding, three single-layer GRUs (each returns ``(output, state)``) and a head: a causal LM."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.grus = nn.ModuleList(nn.GRU(WIDTH, WIDTH, batch_first=True) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding (the zoo's LM data fault scales its output)."""
        return self.embed

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for gru in self.grus:
            x = gru(x)[0]
        return self.head(x)


class GRULM(nn.Module):
    """The GRU stack as ``net``, as the zoo's LMs hold theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = GRUStack()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(tokens)


def _targets(middle: str, linear: str = "") -> dict[str, str]:
    return {**dict.fromkeys(("ramp", "jump", "dead", "nan", "vanish", "lr100"), middle), "data": "",
            **({"vanish": linear, "lr100": linear} if linear else {})}


SWEEP_RECIPES = {
    "bert": Recipe("bert", lambda: LM("bert"), lm_batches, "lm", "adamw", 1e-3, 8, {
        **_targets("net.bert.encoder.layer.2.output.dense", "net.bert.encoder.layer.2.intermediate.dense"),
        "attn": "net.bert.encoder.layer.2.attention.self.query"}),
    "neox": Recipe("neox", lambda: LM("neox"), lm_batches, "lm", "adamw", 1e-3, 8, {
        **_targets("net.gpt_neox.layers.2.mlp.dense_4h_to_h", "net.gpt_neox.layers.2.mlp.dense_h_to_4h"),
        "attn": "net.gpt_neox.layers.2.attention.query_key_value"}),
    "mlp-deep-ln": Recipe("mlp-deep-ln", deep_mlp, regression_batches, "mse", "adam", 1e-3, 32, _targets("15")),
    "cnn-gn": Recipe("cnn-gn", lambda: CNN(norm=lambda c: nn.GroupNorm(4, c)), image_batches, "ce", "sgd", 0.05, 32,
                     _targets("blocks.1.conv1")),
    "vit": Recipe("vit", ViT, image_batches, "ce", "adamw", 1e-3, 32, _targets("blocks.1.fc2", "blocks.1.fc1")),
    "gru": Recipe("gru", GRULM, lm_batches, "lm", "adam", 3e-3, 8, _targets("net.grus.1")),
}
RECIPES.update(SWEEP_RECIPES)
