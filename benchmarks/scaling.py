"""Host cost per hooked module: stacks of 10, 100 and 1000 ``Linear(64, 64)``, and a GPT-2-style decoder.

On a GPU the kernels of a small layer take microseconds and the host's Python is what stalls the
launch queue, so the figure that matters for a large model is host time per hooked module. Each
configuration is timed side by side with plain training in interleaved rounds (the harness of
``overhead.py``), on steps that are not logged and on steps that are; the report gives the
extra time per step, wall and CPU, and divided by the hooked modules.

    python benchmarks/scaling.py                # about 4 minutes on 2 cores
    python benchmarks/scaling.py --depths 10,100 --rounds 2 --steps 6
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from harness import Config, Schedule, Workload, timed_rounds
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_hooks import (
    ActivationMonitor,
    GradientAnomalyStopping,
    GradientMonitor,
    TransformerStability,
    select_modules,
)

NEVER = 10**9  # a log interval no fit reaches: only the first step may log


class Stack(pl.LightningModule):
    """``depth`` x ``Linear(64, 64)``, regression with SGD: one hooked module and two parameters per layer."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(depth)])
        for layer in self.net:  # keep the signal O(1) through a deep linear stack
            nn.init.orthogonal_(layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class CausalSelfAttention(nn.Module):
    """GPT-2's attention through ``F.scaled_dot_product_attention``, as nanoGPT writes it."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        return self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """A GPT-2 block: pre-LayerNorm causal self-attention and a GELU MLP, as ``transformers`` lays it out."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.c_fc, self.act, self.mlp_proj = nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))


class Decoder(pl.LightningModule):
    """A GPT-2-style decoder built from its sizes (no download): token and position embeddings, blocks, tied head."""

    def __init__(self, layers: int = 12, width: int = 64, heads: int = 4, vocab: int = 512, context: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def _stack_batches(n: int) -> list[Any]:
    gen = torch.Generator().manual_seed(1)
    distinct = [(torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen)) for _ in range(4)]
    return [distinct[i % 4] for i in range(n)]


def _decoder_batches(n: int) -> list[Any]:
    gen = torch.Generator().manual_seed(1)
    distinct = [torch.randint(0, 512, (8, 65), generator=gen) for _ in range(4)]
    return [(d[:, :-1], d[:, 1:]) for d in (distinct[i % 4] for i in range(n))]


def workloads(depths: list[int], decoder: bool) -> dict[str, Workload]:
    out = {f"stack{d}": Workload(functools.partial(Stack, d), _stack_batches) for d in depths}
    if decoder:
        out["gpt2-style"] = Workload(Decoder, _decoder_batches)
    return out


class EmptyForwardHooks(Callback):
    """A forward hook that does nothing on each module ActivationMonitor hooks: PyTorch's own hook dispatch."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        modules = [module for _, module in select_modules(pl_module, ActivationMonitor(max_rows=None).modules)]
        self._handles = [m.register_forward_hook(lambda module, args, output: None) for m in modules]

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()


class KeptActivationMonitor(ActivationMonitor):
    """ActivationMonitor with its hooks registered for the whole fit, gated by a flag alone (as before #35)."""

    _hooks_follow_gate = False


def configs() -> dict[str, Config]:
    """Plain training, the Quick start's three callbacks (never and always logged), and each monitor alone."""

    def quick_start(every: int) -> Callable[[str], list[Callback]]:
        return lambda tmp: [ActivationMonitor(log_every_n_steps=every, max_rows=None),
                            GradientMonitor(log_every_n_steps=every, max_rows=None),
                            GradientAnomalyStopping(action="skip")]

    def kept_quick_start(tmp: str) -> list[Callback]:
        return [KeptActivationMonitor(log_every_n_steps=NEVER, max_rows=None),
                GradientMonitor(log_every_n_steps=NEVER, max_rows=None), GradientAnomalyStopping(action="skip")]

    always = lambda step: True  # noqa: E731
    return {c.name: c for c in [
        Config("none", "no callbacks (baseline)", lambda tmp: []),
        Config("quick start, not logged", "ActivationMonitor + GradientMonitor + GradientAnomalyStopping(skip)",
               quick_start(NEVER)),
        Config("quick start, not logged, hooks kept", "the same with ActivationMonitor's hooks registered for the"
               " whole fit (before #35)", kept_quick_start),
        Config("ActivationMonitor, not logged, hooks kept", "ActivationMonitor alone, its hooks registered for the"
               " whole fit (before #35)", lambda tmp: [KeptActivationMonitor(log_every_n_steps=NEVER, max_rows=None)]),
        Config("quick start (warn), not logged", "the three with GradientAnomalyStopping(action='warn'): its check"
               " read a step late", lambda tmp: [ActivationMonitor(log_every_n_steps=NEVER, max_rows=None),
                                                 GradientMonitor(log_every_n_steps=NEVER, max_rows=None),
                                                 GradientAnomalyStopping(action="warn")]),
        Config("empty forward hooks", "a no-op forward hook per module: PyTorch's own hook dispatch",
               lambda tmp: [EmptyForwardHooks()]),
        Config("ActivationMonitor, not logged", "ActivationMonitor alone on steps it does not log",
               lambda tmp: [ActivationMonitor(log_every_n_steps=NEVER, max_rows=None)]),
        Config("GradientMonitor, not logged", "GradientMonitor alone on steps it does not log (its check reads"
               " the gradients)", lambda tmp: [GradientMonitor(log_every_n_steps=NEVER, max_rows=None)]),
        Config("gradient check alone", "GradientAnomalyStopping(skip) alone: one read of the gradients a step",
               lambda tmp: [GradientAnomalyStopping(action="skip")]),
        Config("quick start, logged", "the same, logging every step", quick_start(1), always),
        Config("ActivationMonitor, logged", "ActivationMonitor alone, every step",
               lambda tmp: [ActivationMonitor(log_every_n_steps=1, max_rows=None)], always),
        Config("GradientMonitor, logged", "GradientMonitor alone, every step",
               lambda tmp: [GradientMonitor(log_every_n_steps=1, max_rows=None)], always),
        Config("TransformerStability, not logged", "TransformerStability on steps it does not log",
               lambda tmp: [TransformerStability(log_every_n_steps=NEVER)]),
        Config("TransformerStability, logged", "TransformerStability alone, every step (the decoder: attention,"
               " logits, blocks; a stack: its output as logits)",
               lambda tmp: [TransformerStability(log_every_n_steps=1)], always),
    ]}


def hooked_modules(workload: Workload) -> int:
    """How many modules ActivationMonitor's default selection hooks in the workload's model."""
    monitor = ActivationMonitor(max_rows=None)
    monitor.attach(workload.model())
    count = len(monitor.module_names)
    monitor.detach()
    return count


def per_step(runs: Any, model: str, name: str, column: int) -> Optional[float]:
    """Median over fits of (median step of the fit - median step of its neighbouring baselines), seconds."""
    extras = []
    for (kind, _), fits in runs.items():
        if kind != model:
            continue
        for i, (fit_name, steps) in enumerate(fits):
            if fit_name != name or not steps:
                continue
            bases = [statistics.median(s[column] for s in f[1]) for f in (
                next((f for f in reversed(fits[:i]) if f[0] == "none"), None),
                next((f for f in fits[i + 1:] if f[0] == "none"), None)) if f and f[1]]
            if bases:
                extras.append(statistics.median(s[column] for s in steps) - statistics.mean(bases))
    return statistics.median(extras) if extras else None


def report(runs: Any, models: dict[str, Workload], names: list[str]) -> tuple[str, dict[str, Any]]:
    lines = ["| model | hooked modules | plain step (ms) | configuration | extra per step: wall (ms) | CPU (ms) |"
             " per module: wall (us) | CPU (us) |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    figures: dict[str, Any] = {}
    for model, workload in models.items():
        n = hooked_modules(workload)
        base = [s[1] for (kind, _), fits in runs.items() if kind == model for name, f in fits if name == "none"
                for s in f]
        plain = statistics.median(base) * 1e3
        figures[model] = {"modules": n, "plain_ms": plain}
        for name in names[1:]:
            wall, cpu = per_step(runs, model, name, 1), per_step(runs, model, name, 2)
            if wall is None or cpu is None:
                continue
            figures[model][name] = {"wall_ms": wall * 1e3, "cpu_ms": cpu * 1e3}
            lines.append(f"| {model} | {n} | {plain:.2f} | {name} | {wall * 1e3:.2f} | {cpu * 1e3:.2f} |"
                         f" {wall * 1e6 / n:.1f} | {cpu * 1e6 / n:.1f} |")
    return "\n".join(lines), figures


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="10,100,1000", help="stack depths, comma-separated")
    parser.add_argument("--no-decoder", action="store_true", help="leave out the GPT-2-style decoder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per fit")
    parser.add_argument("--fit-seconds", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--output", default=None, help="write the figures here as JSON")
    parser.add_argument("--configs", default=None,
                        help="configurations to time, names separated by semicolons (the baseline 'none' is always in)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = workloads([int(d) for d in args.depths.split(",") if d], not args.no_decoder)
    chosen = configs()
    if args.configs:
        wanted = {"none", *(name.strip() for name in args.configs.split(";"))}
        unknown = wanted - set(chosen)
        if unknown:
            parser.error(f"unknown configurations {sorted(unknown)}: choose from {sorted(chosen)}")
        chosen = {name: config for name, config in chosen.items() if name in wanted}
    schedule = Schedule(steps=args.steps, rounds=args.rounds, warmup=2, min_steps=3, fit_seconds=args.fit_seconds)
    with tempfile.TemporaryDirectory() as tmp:
        runs = timed_rounds(chosen, models, schedule, tmp)
    table, figures = report(runs, models, list(chosen))
    print(table)
    if args.output:
        Path(args.output).write_text(json.dumps(figures, indent=1))
    return 0 if all(math.isfinite(v["plain_ms"]) for v in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
