"""The fault zoo's models, data and recipes: small real networks on data with learnable structure.

A GPT-2 and a LLaMA built from ``transformers`` configs (6 layers, width 64), a hand-written CNN
with BatchNorm and residual adds, and a plain MLP. Each has a healthy standard recipe (optimizer
and schedule), and names the module in the *middle* of the network that each fault is injected in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

VOCAB, SEQ, WIDTH, DEPTH = 64, 16, 64, 6


def lm_batches(seed: int, batch: int) -> Callable[[int], tuple[Tensor, Tensor]]:
    """Token sequences from a fixed sparse Markov chain (each token has 3 likely successors): learnable."""
    g = torch.Generator().manual_seed(seed)
    nexts = torch.randint(0, VOCAB, (VOCAB, 3), generator=g)

    def draw(step: int) -> tuple[Tensor, Tensor]:
        gs = torch.Generator().manual_seed(seed * 100003 + step)
        tokens = torch.empty(batch, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gs)
        choice = torch.randint(0, 3, (batch, SEQ), generator=gs)
        for t in range(SEQ):
            tokens[:, t + 1] = nexts[tokens[:, t], choice[:, t]]
        return tokens[:, :-1], tokens[:, 1:]
    return draw


def image_batches(seed: int, batch: int) -> Callable[[int], tuple[Tensor, Tensor]]:
    """8x8 three-channel images: one of 10 fixed class patterns plus noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 3, 8, 8, generator=g)

    def draw(step: int) -> tuple[Tensor, Tensor]:
        gs = torch.Generator().manual_seed(seed * 100003 + step)
        labels = torch.randint(0, 10, (batch,), generator=gs)
        return patterns[labels] + 0.8 * torch.randn(batch, 3, 8, 8, generator=gs), labels
    return draw


def regression_batches(seed: int, batch: int) -> Callable[[int], tuple[Tensor, Tensor]]:
    """``y = teacher(x)`` with a fixed random two-layer teacher, plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(16, 32, generator=g) / 4, torch.randn(32, 1, generator=g) / 6

    def draw(step: int) -> tuple[Tensor, Tensor]:
        gs = torch.Generator().manual_seed(seed * 100003 + step)
        x = torch.randn(batch, 16, generator=gs)
        return x, torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(batch, 1, generator=gs)
    return draw


def gpt2(transformers: Any, width: int = WIDTH, layers: int = DEPTH, heads: int = 4) -> nn.Module:
    """The zoo's GPT-2 (no dropout), ``width`` wide and ``layers`` blocks deep."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=width, n_layer=layers, n_head=heads, activation_function="gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class LM(nn.Module):
    """A causal LM from ``transformers`` that returns its logits."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import transformers

        if kind in SWEEP_LMS:
            self.net = SWEEP_LMS[kind](transformers)
        elif kind == "gpt2":
            self.net = gpt2(transformers)
        else:
            config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH,
                                              num_hidden_layers=DEPTH, num_attention_heads=4, num_key_value_heads=4,
                                              max_position_embeddings=SEQ)
            self.net = transformers.LlamaForCausalLM(config)
        self.net.config.use_cache = False

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(input_ids=tokens).logits


def _bert(transformers: Any) -> nn.Module:
    """A post-LayerNorm encoder (bidirectional attention): each block's outputs go through a LayerNorm."""
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=DEPTH,
        num_attention_heads=4, max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _neox(transformers: Any) -> nn.Module:
    """A GPT-NeoX: parallel residual (attention and MLP read the same input), rotary positions."""
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=DEPTH,
        num_attention_heads=4, max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0))


#: The fault sweep's language models (``benchmarks/fault_sweep.py``), built from configs alone (no download).
SWEEP_LMS: dict[str, Callable[[Any], nn.Module]] = {"bert": _bert, "neox": _neox}


class Block(nn.Module):
    """A residual block: conv, norm, ReLU, conv, norm, then the residual add and a ReLU (BatchNorm, or ``norm``)."""

    def __init__(self, width: int, norm: Callable[[int], nn.Module] = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1, bias=False), norm(width)
        self.relu1 = nn.ReLU()
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), norm(width)
        self.relu2 = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.relu2(x + self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x))))))


class CNN(nn.Module):
    """A stem, four residual blocks and a linear head, on 8x8 images."""

    def __init__(self, width: int = 16, norm: Callable[[int], nn.Module] = nn.BatchNorm2d) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), norm(width), nn.ReLU())
        self.blocks = nn.Sequential(*(Block(width, norm) for _ in range(4)))
        self.pool, self.head = nn.AdaptiveAvgPool2d(1), nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pool(self.blocks(self.stem(x))).flatten(1))


def mlp(width: int = 64, activation: Callable[[], nn.Module] = nn.ReLU, dropout: float = 0.0) -> nn.Module:
    """Six Linear layers with ``activation`` between (then dropout, if any), 16 -> 1 (``width`` wide between)."""
    sizes = [16, *[width] * 5, 1]
    layers: list[nn.Module] = []
    for i in range(6):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < 5:
            layers += [activation(), *([nn.Dropout(dropout)] if dropout else [])]
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class Recipe:
    """A model with its data, loss, optimizer and schedule, and the middle modules its faults go in."""

    name: str
    build: Callable[[], nn.Module]
    data: Callable[[int, int], Callable[[int], tuple[Tensor, Tensor]]]
    loss: str  # "lm", "ce" or "mse"
    optimizer: str  # "adamw", "adamw-flat" (constant LR), "sgd", "sgd-nesterov", "adam", or OTHER_OPTIMIZERS
    lr: float
    batch: int
    targets: dict[str, str]  # fault -> the module it is injected in (the culprit)
    precision: str = "32-true"
    cycle: int = 0  # a cyclic LR (triangular, from lr/10 up to lr and back) of this many steps; 0: the usual schedule
    clip: float = 0.0  # the gradients' norm clipped to this (Lightning's ``gradient_clip_val``); 0: not clipped
    accumulate: int = 1  # micro-batches a step (Lightning's ``accumulate_grad_batches``), each drawn apart
    weight_decay: float = 5e-4  # SGD's (the other optimizers keep their own)
    frozen: str = ""  # a module of the model whose parameters do not train (``requires_grad`` off); "": none
    thaw: float = 0.0  # when ``frozen`` starts to train, as a fraction of the run; 0: never


def _lm_targets(block: str, mlp_in: str, mlp_out: str, query: str) -> dict[str, str]:
    return {"ramp": mlp_out, "jump": mlp_out, "dead": mlp_out, "nan": mlp_out, "vanish": mlp_in,
            "lr100": mlp_in, "attn": query, "data": ""}


RECIPES = {
    "gpt2": Recipe("gpt2", lambda: LM("gpt2"), lm_batches, "lm", "adamw", 1e-3, 8, _lm_targets(
        "net.transformer.h.2", "net.transformer.h.2.mlp.c_fc", "net.transformer.h.2.mlp.c_proj",
        "net.transformer.h.2.attn.c_attn")),
    "llama": Recipe("llama", lambda: LM("llama"), lm_batches, "lm", "adamw", 6e-4, 8, _lm_targets(
        "net.model.layers.2", "net.model.layers.2.mlp.up_proj", "net.model.layers.2.mlp.down_proj",
        "net.model.layers.2.self_attn.q_proj")),
    "cnn": Recipe("cnn", CNN, image_batches, "ce", "sgd", 0.05, 32, {
        **dict.fromkeys(("ramp", "jump", "dead", "nan", "vanish", "lr100"), "blocks.1.conv1"), "data": ""}),
    "mlp": Recipe("mlp", mlp, regression_batches, "mse", "adam", 1e-3, 32, {
        **dict.fromkeys(("ramp", "jump", "dead", "nan", "vanish", "lr100"), "4"), "data": ""}),
}
RECIPES["gpt2-bf16"] = Recipe(**{**vars(RECIPES["gpt2"]), "name": "gpt2-bf16", "precision": "bf16-mixed"})


RESTARTS = 4  # ``-restarts`` schedules: this many cosine periods in a run


def schedule(recipe: Recipe, steps: int) -> Callable[[int], float]:
    """The LR multiplier: warm-up (10%) and cosine for the transformers, step decay for the CNN, flat else.

    The fault sweep's ``unseen7`` adds AdamW with a warm-up over 40% of the run (``adamw-warm40``), with
    linear decay to 0 (``adamw-linear``) and with a one-cycle LR (``adamw-onecycle``).
    The sweep's ``unseen15`` adds cosine with warm restarts (SGDR, Loshchilov and Hutter 2017,
    ``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``) after a 10% warm-up, restarting every
    ``RESTARTS``-th of the run (``adamw-restarts``, ``sgd-restarts``).
    A recipe with a ``cycle`` has a triangular cyclic LR (Smith 2017, ``torch.optim.lr_scheduler.CyclicLR``):
    from a tenth of its LR up to its LR in half a cycle, and back.
    """
    if recipe.cycle:
        return lambda s: 0.1 + 0.9 * (1 - abs(2 * (s % recipe.cycle) / recipe.cycle - 1))
    if recipe.optimizer in ("adamw", "adamw-warm40"):  # the sweep's unseen7: a warm-up over 40% of the run
        warm = max(1, steps * (4 if recipe.optimizer == "adamw-warm40" else 1) // 10)
        return lambda s: (s + 1) / warm if s < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / steps))
    if recipe.optimizer == "adamw-linear":  # warm-up (10%), then linear decay to 0 at the last step
        warm = max(1, steps // 10)
        return lambda s: (s + 1) / warm if s < warm else max(0.0, 1 - (s - warm) / (steps - warm))
    if recipe.optimizer == "adamw-onecycle":  # torch's OneCycleLR: lr/25 up to lr (cosine, 30%), down to ~0
        up = max(1, int(0.3 * steps))
        return lambda s: (1 / 25 + (1 - 1 / 25) * (1 - math.cos(math.pi * s / up)) / 2 if s < up else
                          1e-5 + (1 - 1e-5) * (1 + math.cos(math.pi * (s - up) / max(1, steps - up))) / 2)
    if recipe.optimizer.endswith("-restarts"):  # the LR back at its peak at each restart
        warm, period = max(1, steps // 10), max(1, steps // RESTARTS)
        return lambda s: (s + 1) / warm if s < warm else 0.01 + 0.495 * (1 + math.cos(math.pi * ((s - warm) % period)
                                                                                     / period))
    if recipe.optimizer.startswith("sgd"):
        return lambda s: 0.1 ** (s // max(1, steps // 3))
    return lambda s: 1.0
RECIPES["mlp-cyclic"] = Recipe(**{**vars(RECIPES["mlp"]), "name": "mlp-cyclic", "lr": 5e-3, "cycle": 60})
RECIPES["cnn-cyclic"] = Recipe(**{**vars(RECIPES["cnn"]), "name": "cnn-cyclic", "lr": 0.2, "cycle": 60})
