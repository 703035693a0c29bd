"""The fault sweep's sixteenth unseen groups: coarse logging with every fault.

- ``unseen16``: logged every 20 steps over 600 (the onset at 300): every fault on LLaMA, and the faults
  ``unseen15c`` left out (dead units, a vanishing signal, an LR x100, a NaN, the data) on GPT-2, the MLP and the CNN.
- ``unseen16b``: logged every 50 steps (Lightning's default) over 1,500 (30 points, the onset at 750): a ramp, a
  jump and the healthy run on GPT-2, the MLP and the CNN.
- ``unseen16c``: modules called several times a step: an ALBERT (one encoder layer shared by all six: its hooks
  fire six times a forward pass) with every fault in its shared layer, and an MLP that applies one hidden Linear
  three times (a looped depth), its fault in that Linear.
- ``unseen16d``: a torchvision-style ResNet: each block's one ``ReLU`` module applied twice (after its first norm and
  after the residual add), a downsampling block with a 1x1 projection shortcut; every fault in a middle block's
  first convolution, and in its second.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from benchmarks._sweep_variant import Variant
from benchmarks._zoo_models import (
    DEPTH,
    LM,
    RECIPES,
    SEQ,
    SWEEP_LMS,
    VOCAB,
    WIDTH,
    Recipe,
    image_batches,
    lm_batches,
    regression_batches,
)

ALBERT = "net.albert.encoder.albert_layer_groups.0.albert_layers.0"


def _albert(transformers: Any) -> nn.Module:
    """An ALBERT: one post-LayerNorm encoder layer, shared by all ``DEPTH`` layers (factorised embeddings)."""
    return transformers.AlbertForMaskedLM(transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=WIDTH // 2, hidden_size=WIDTH, num_hidden_layers=DEPTH, num_attention_heads=4,
        intermediate_size=4 * WIDTH, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


class LoopedMLP(nn.Module):
    """An MLP whose one hidden Linear (``shared``, with a ReLU) is applied three times: a looped depth."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.shared, self.act, self.out = nn.Linear(16, 64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.act(self.first(x))
        for _ in range(3):
            x = self.act(self.shared(x))
        return self.out(x)


class TorchvisionBlock(nn.Module):
    """torchvision's ``BasicBlock``: conv, norm, its ``relu``, conv, norm, the shortcut added, ``relu`` again."""

    def __init__(self, width: int, stride: int = 1, into: int = 0) -> None:
        super().__init__()
        into = into or width
        self.conv1, self.bn1 = nn.Conv2d(into, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width)
        self.downsample = (nn.Sequential(nn.Conv2d(into, width, 1, stride, bias=False), nn.BatchNorm2d(width))
                           if stride != 1 or into != width else None)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class TorchvisionResNet(nn.Module):
    """A small torchvision-style ResNet on 8x8 images: stem, two blocks at 16 channels, two at 32 (the first
    downsampling), pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(True)
        self.layer1 = nn.Sequential(TorchvisionBlock(16), TorchvisionBlock(16))
        self.layer2 = nn.Sequential(TorchvisionBlock(32, 2, 16), TorchvisionBlock(32))
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(32, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(self.avgpool(x).flatten(1))


SWEEP_LMS["albert"] = _albert
_FAULTS = ("ramp", "jump", "dead", "nan")
RECIPES["albert"] = Recipe("albert", lambda: LM("albert"), lm_batches, "lm", "adamw", 1e-3, 8, {
    **dict.fromkeys(_FAULTS, f"{ALBERT}.ffn_output"), **dict.fromkeys(("vanish", "lr100"), f"{ALBERT}.ffn"),
    "attn": f"{ALBERT}.attention.query", "data": ""})
RECIPES["resnet-tv"] = Recipe("resnet-tv", TorchvisionResNet, image_batches, "ce", "sgd", 0.05, 32, {
    **dict.fromkeys((*_FAULTS, "vanish", "lr100"), "layer1.1.conv1"), "data": ""})
RECIPES["mlp-looped"] = Recipe("mlp-looped", LoopedMLP, regression_batches, "mse", "adam", 1e-3, 32, {
    **dict.fromkeys((*_FAULTS, "vanish", "lr100"), "shared"), "data": ""})

REST = ("dead", "vanish", "lr100", "nan", "data")


def unseen16() -> dict[str, list[Variant]]:
    """The groups: ``unseen16`` (every 20, every fault), ``unseen16b`` (every 50), ``unseen16c`` (shared modules)."""
    first = [Variant("unseen16", "llama", ("healthy", "ramp", "jump", *REST, "attn"), every=20, steps=600)]
    first += [Variant("unseen16", m, REST, every=20, steps=600) for m in ("gpt2", "mlp", "cnn")]
    second = [Variant("unseen16b", m, ("healthy", "ramp", "jump"), every=50, steps=1500)
              for m in ("gpt2", "mlp", "cnn")]
    every = ("healthy", "ramp", "jump", *REST)
    third = [Variant("unseen16c", "albert", (*every, "attn")), Variant("unseen16c", "mlp-looped", every)]
    fourth = [Variant("unseen16d", "resnet-tv", every), Variant("unseen16d", "resnet-tv", ("ramp", "jump", "dead"),
                                                                target="layer1.1.conv2")]
    return {"unseen16": first, "unseen16b": second, "unseen16c": third, "unseen16d": fourth}
