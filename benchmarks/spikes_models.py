"""The spike trigger on healthy runs of many models and recipes: how many steps it flags after the first 10%.

Each run is one of the fault zoo's and the sweep's recipes (``benchmarks/_zoo_models.py``,
``_sweep_models.py``, ``_sweep_models4.py``: GPT-2, LLaMA, BERT, GPT-NeoX, Qwen2, OPT, GPT-J, Phi,
Falcon, BLOOM, Gemma, ViT, GRU, LSTM, CNNs with BatchNorm and GroupNorm, a pre-activation ResNet,
an MLP-Mixer, a ConvNeXt, a WaveNet, a U-Net, an autoencoder, a MoE, MLPs for regression and
classification), trained without a fault in a plain torch loop as the zoo trains it (its optimizer,
schedule, precision), some longer (1,000-2,000 steps), with small batches, or with another
optimizer (RMSprop, Adagrad, Adafactor, SGD). Each step's loss (as backpropagated) and total
gradient norm (before clipping), what ``GradientAnomalyStopping(spikes=...)`` judges, are saved
(``--store``, one ``.pt`` per run) and replayed through
:class:`~lightning_hooks.measure.spikes.SpikeWindows` in seconds. A flag after the first 10% of a
healthy run is a false alarm; the table gives their count per signal and the worst case: the
value against the level it was judged by (the median of its recent values) and its z-score.

    python benchmarks/spikes_models.py                    # records what is missing, then the table
    python benchmarks/spikes_models.py --runs gpt2 cnn-1000   # some runs only
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import benchmarks._sweep_models  # noqa: E402,F401  (adds the sweep's recipes)
import benchmarks._sweep_models4  # noqa: E402,F401
from benchmarks._zoo_models import RECIPES, schedule  # noqa: E402
from benchmarks.fault_zoo import Lit  # noqa: E402
from lightning_hooks.measure.spikes import SPIKE_SIGNALS, SpikeTrigger, SpikeWindows  # noqa: E402

STORE = "/work/rec5"


@dataclass(frozen=True)
class Run:
    """One healthy run: a zoo recipe, and what differs from it."""

    model: str
    steps: int = 300
    batch: int = 0  # 0: the recipe's own
    optimizer: str = ""
    lr: float = 0.0
    precision: str = ""
    seed: int = 0

    @property
    def name(self) -> str:
        parts = [self.model, str(self.steps), self.batch and f"b{self.batch}", self.optimizer,
                 self.lr and f"lr{self.lr:g}", self.precision, self.seed and f"s{self.seed}"]
        return "-".join(p for p in parts if p)


def runs() -> list[Run]:
    """Every recipe at 300 steps; long runs, small batches, other optimizers and seeds on some."""
    out = [Run(m) for m in RECIPES if m not in ("gpt2-bf16",)]
    out += [Run("gpt2", precision="bf16-mixed"), Run("llama", precision="bf16-mixed"),
            Run("cnn", precision="bf16-mixed")]
    out += [Run(m, 1000) for m in ("gpt2", "llama", "cnn", "mlp", "mlp-cls", "vit", "autoenc", "unet", "moe")]
    out += [Run(m, 2000) for m in ("mlp", "mlp-cls", "cnn-plain", "mlp-cyclic")]
    out += [Run(m, 2000, batch=b) for m, b in (("mlp", 4), ("mlp", 8), ("autoenc", 8), ("moe", 8),
                                               ("mlp-cls", 8), ("mlp-deep-ln", 8))]
    out += [Run(m, 1000, batch=8, seed=1) for m in ("mlp-cls", "cnn", "resnet-preact", "mixer", "convnext")]
    out += [Run("mlp", 1000, optimizer="rmsprop", lr=1e-3), Run("moe", 1000, optimizer="rmsprop", lr=1e-3),
            Run("cnn", 1000, optimizer="adagrad", lr=0.05), Run("mlp-cls", 1000, optimizer="plain-sgd", lr=0.05),
            Run("gpt2", 1000, optimizer="adafactor", lr=1e-2), Run("llama", 300, optimizer="adafactor", lr=1e-2),
            Run("mlp", 2000, batch=8, optimizer="rmsprop", lr=1e-3), Run("autoenc", 1000, optimizer="adagrad",
                                                                            lr=0.05)]
    # The sweep's unseen15: cosine with warm restarts (the LR back at its peak four times a run), RAdam, NAdam, Adamax
    out += [Run("gpt2", 1000, optimizer="adamw-restarts", lr=1e-3), Run("mlp", 1000, optimizer="adamw-restarts",
                                                                        lr=2e-3),
            Run("cnn", 1000, optimizer="sgd-restarts", lr=0.05), Run("mlp", 1000, batch=8, optimizer="adamw-restarts",
                                                                     lr=2e-3),
            Run("mlp", 1000, optimizer="radam", lr=1e-3), Run("mlp", 1000, optimizer="nadam", lr=1e-3),
            Run("mlp", 1000, optimizer="adamax", lr=2e-3), Run("llama", 300, optimizer="nadam", lr=6e-4)]
    return out


def _loss(kind: str, out: Tensor, y: Tensor) -> Tensor:
    if kind == "lm":
        return nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())
    if kind == "ce":
        return nn.functional.cross_entropy(out.float(), y)
    return nn.functional.mse_loss(out.float(), y)


def record(run: Run) -> Tensor:
    """``(steps, 2)`` float64: each step's loss and total gradient norm, trained as the zoo trains the recipe."""
    base = RECIPES[run.model]
    recipe = replace(base, batch=run.batch or base.batch, optimizer=run.optimizer or base.optimizer,
                     lr=run.lr or base.lr, precision=run.precision or base.precision, accumulate=1)
    lit = Lit(recipe, None, 0, run.steps, run.seed, 1)  # seeds, builds the model (no fault)
    model, optimizer = lit.model.train(), lit.configure_optimizers()
    draw, mult = recipe.data(run.seed, recipe.batch), schedule(recipe, run.steps)
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for step in range(run.steps):
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr * mult(step)
        x, y = draw(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.precision == "bf16-mixed"):
            out = model(x)
        loss = _loss(recipe.loss, out, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.stack([p.grad.double().norm() for p in params if p.grad is not None]).norm()
        rows.append(torch.stack([loss.detach().double(), norm]))
        if recipe.clip:
            nn.utils.clip_grad_norm_(params, recipe.clip)
        optimizer.step()
    return torch.stack(rows)


def series(run: Run, store: str) -> Tensor:
    """The run's recorded series from ``store``, recorded (and saved) first if missing."""
    path = os.path.join(store, f"spike_series_{run.name}.pt")
    if not os.path.exists(path):
        start = time.perf_counter()
        values = record(run)
        torch.save({"run": vars(run), "values": values}, path)
        print(f"recorded {run.name} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return torch.load(path)["values"]


def replay(values: Tensor, trigger: SpikeTrigger) -> tuple[Tensor, Tensor, Tensor]:
    """Each step's z-scores, flags and level (the median of the recent values it was judged by), per signal."""
    windows, zs, flags, levels = SpikeWindows(trigger), [], [], []
    recent = max(8, trigger.window // 8)
    for step, row in enumerate(values):
        z, flag = windows.judge(row)
        past = values[max(0, step - recent):step]
        levels.append(past.nanmedian(0).values if len(past) else torch.full_like(row, math.nan))
        zs.append(z)
        flags.append(flag)
        windows.remember(row)
    return torch.stack(zs), torch.stack(flags), torch.stack(levels)


def row(run: Run, values: Tensor, trigger: SpikeTrigger) -> tuple[str, int]:
    """The run's table line, and its number of false flags after the first 10%."""
    z, flags, levels = replay(values, trigger)
    start = len(values) // 10
    cells, total = [], 0
    for s, _ in enumerate(SPIKE_SIGNALS[:2]):
        late = flags[start:, s]
        total += int(late.sum())
        worst = start + int(z[start:, s].argmax())
        cells += [str(int(late.sum())), f"{z[worst, s].item():.1f} at {worst}: {values[worst, s].item():.2g}"
                  f" vs {levels[worst, s].item():.2g}"]
    final = values[-max(1, len(values) // 10):, 0].median().item()
    return f"| {run.name} | {final:.1e} | " + " | ".join(cells) + " |", total


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", help="run names (default: all)")
    parser.add_argument("--store", default=STORE, help="where the series are saved")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.store, exist_ok=True)
    trigger = SpikeTrigger()
    print(f"Default {trigger}: healthy runs, steps flagged after the first 10%, and the highest z there\n")
    print("| run | final loss | loss flags | loss: highest z at step: value vs level | grad-norm flags |"
          " grad norm: highest z at step: value vs level |")
    print("|---|---:|---:|---|---:|---|")
    total = 0
    for run in runs():
        if args.runs and run.name not in args.runs and run.model not in args.runs:
            continue
        line, flagged = row(run, series(run, args.store), trigger)
        total += flagged
        print(line, flush=True)
    print(f"\n{total} steps flagged after the first 10% in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
