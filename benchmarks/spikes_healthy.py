"""The spike trigger's judgement: false flags on healthy runs, and how soon it catches real spikes.

Healthy recipes: Adam on small-batch regression (a student fitting a teacher of its own shape,
so the loss falls to 1e-5..1e-3 and wanders by factors from batch to batch), run to convergence,
3,000 steps: an MLP and a tiny attention model, batch 8, two seeds each. Each run's loss and
total gradient norm (what ``GradientAnomalyStopping(spikes=...)`` judges: the loss as
backpropagated, the norm of all gradients) are recorded in a plain torch loop, then replayed
through two judges: ``before`` (the robust z-score on the linear scale, warm-up counted in
steps, as shipped before issue 29) and ``now`` (:class:`~lightning_hooks.measure.spikes.SpikeWindows`,
the package's own). Then faults injected at step 2,000 of each run, replayed the same way: one
corrupt batch (inputs x10), one batch of wrong targets (+3), and the learning rate x30 from there
on; the delay is from the fault's step to the first flag (0: caught at once).

With ``--rollback`` the healthy runs are also trained by Lightning with the real
``GradientAnomalyStopping(action="rollback", spikes=SpikeTrigger(), skip_batches=10)``: how many
steps were flagged, rollbacks made, updates dropped, and the final loss (the mean of the last
10%) beside a run without it. Run it with ``PYTHONPATH`` at another checkout for its figures.

    python benchmarks/spikes_healthy.py            # about 5 minutes on 2 loaded cores
    python benchmarks/spikes_healthy.py --steps 1200 --seeds 1   # a quick look
    python benchmarks/spikes_healthy.py --rollback --seeds 1     # the stopper itself, in Lightning
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Iterator
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradientAnomalyStopping, SpikeTrigger
from lightning_hooks.measure.spikes import _MAD_TO_STD, SpikeWindows

FAULTS = ("corrupt batch (x10)", "wrong targets (+3)", "lr x30")


class Attention(nn.Module):
    """A tiny attention model: embed, one self-attention block with a residual and LayerNorm, a mean-pooled head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(4, width), nn.Linear(width, 1)
        self.attn, self.norm = nn.MultiheadAttention(width, 2, batch_first=True), nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(h).mean(1)


def model(kind: str) -> nn.Module:
    """An MLP (8 -> 32 -> 32 -> 1, Tanh) or the tiny attention model (sequences of 8 tokens of 4 features)."""
    if kind == "mlp":
        return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    return Attention()


def batches(kind: str, teacher: nn.Module, seed: int, batch: int = 8) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless batches of inputs and the teacher's outputs (no noise: the student can fit them)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, 8) if kind == "mlp" else (batch, 8, 4)
    while True:
        x = torch.randn(*shape, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        yield x, y  # outside no_grad: a generator suspended inside it would leave the student without gradients


def train(kind: str, seed: int, steps: int, fault: Optional[str] = None, at: int = 0) -> Tensor:
    """``(steps, 2)``: each step's loss and total gradient norm, float64; ``fault`` injected at step ``at``."""
    torch.manual_seed(1000 + seed)
    teacher = model(kind)
    torch.manual_seed(seed)
    student = model(kind)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
    rows = []
    for step, (x, y) in zip(range(steps), batches(kind, teacher, seed)):
        if step == at and fault == FAULTS[0]:
            x = x * 10
        if step == at and fault == FAULTS[1]:
            y = y + 3
        if step == at and fault == FAULTS[2]:
            optimizer.param_groups[0]["lr"] *= 30
        loss = nn.functional.mse_loss(student(x), y)
        optimizer.zero_grad()
        loss.backward()
        norm = torch.stack([p.grad.double().norm() for p in student.parameters()]).norm()
        rows.append(torch.stack([loss.detach().double(), norm]))
        optimizer.step()
    return torch.stack(rows)


def judge_before(values: Tensor, trigger: SpikeTrigger) -> list[int]:
    """The steps flagged by the judge shipped before issue 29: linear scale, warm-up counted in steps."""
    flagged, thresholds = [], torch.tensor(trigger.thresholds[: values.shape[1]], dtype=torch.float64)
    for step in range(len(values)):
        window = values[max(0, step - trigger.window):step]
        if step < (trigger.warmup or 1):
            continue
        median = window.nanmedian(0).values
        spread = torch.maximum((window - median).abs().nanmedian(0).values * _MAD_TO_STD,
                               median.abs() * 0.01)  # the default min_spread then
        z = torch.where(spread > 0, (values[step] - median) / spread, 0.0)
        if (z > thresholds).any():
            flagged.append(step)
    return flagged


def judge_now(values: Tensor, trigger: SpikeTrigger) -> list[int]:
    """The steps the package's :class:`SpikeWindows` flags, every value joining the window after it is judged."""
    windows, flagged = SpikeWindows(trigger), []
    for step, row in enumerate(values):
        if windows.judge(row)[1].any():
            flagged.append(step)
        windows.remember(row)
    return flagged


def _delay(flagged: list[int], at: int) -> str:
    after = [step - at for step in flagged if step >= at]
    return str(after[0]) if after else "missed"


def rows(kind: str, seed: int, steps: int, trigger: SpikeTrigger) -> Iterator[str]:
    """The table's rows for one model and seed: the healthy run, then each fault."""
    healthy = train(kind, seed, steps)
    before, now = judge_before(healthy, trigger), judge_now(healthy, trigger)
    level = f"{healthy[-steps // 10:, 0].median().item():.1e}"
    yield (f"| {kind} seed {seed} | healthy, final loss {level} | {len(before)} of {steps} | {len(now)} of {steps} |"
           f" {', '.join(map(str, now[:5])) or '-'} |")
    at = 2 * steps // 3
    for fault in FAULTS:
        faulty = train(kind, seed, min(steps, at + 100), fault, at)
        before, now = judge_before(faulty, trigger), judge_now(faulty, trigger)
        yield f"| {kind} seed {seed} | {fault} at step {at} | delay {_delay(before, at)} | delay {_delay(now, at)} | |"


class Regression(pl.LightningModule):
    """The healthy recipe of :func:`train` as a LightningModule: the student, Adam at 1e-3."""

    def __init__(self, kind: str, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.student = model(kind)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.student(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.student.parameters(), lr=1e-3)


class Losses(pl.Callback):
    """Every step's loss, and the steps whose flags were not empty."""

    def __init__(self, stopper: Optional[GradientAnomalyStopping]) -> None:
        self.stopper, self.losses, self.flagged = stopper, [], 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        self.flagged += bool(self.stopper is not None and self.stopper.last_flags)


def rollback_row(kind: str, seed: int, steps: int) -> str:
    """One healthy recipe in Lightning, with and without the rollback stopper."""
    torch.manual_seed(1000 + seed)
    teacher = model(kind)
    data = [b for _, b in zip(range(steps), batches(kind, teacher, seed))]
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    finals = []
    for stopper in (None, GradientAnomalyStopping(action="rollback", spikes=SpikeTrigger(), skip_batches=10,
                                                  prog_bar=False)):
        seen = Losses(stopper)
        with tempfile.TemporaryDirectory() as tmp:
            pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
                       callbacks=[c for c in (stopper, seen) if c is not None]).fit(
                Regression(kind, seed), DataLoader(TensorDataset(x, y), batch_size=8))
        finals.append(sum(seen.losses[-steps // 10:]) / (steps // 10))
    return (f"| {kind} seed {seed} | {seen.flagged} | {stopper.rollbacks} | {stopper.dropped_steps} |"
            f" {finals[1]:.2e} | {finals[0]:.2e} |")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--rollback", action="store_true", help="the healthy runs in Lightning, with rollback")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.rollback:
        for name in ("lightning.pytorch", "pytorch_lightning"):  # the Trainer's start-up lines
            logging.getLogger(name).setLevel(logging.ERROR)
        print("| model | steps flagged | rollbacks | updates dropped | final loss | without the stopper |")
        print("|---|---:|---:|---:|---:|---:|")
        for kind in ("mlp", "attention"):
            for seed in range(args.seeds):
                print(rollback_row(kind, seed, args.steps), flush=True)
        return 0
    trigger = SpikeTrigger()
    print(f"Default {trigger}: steps flagged (healthy) or delay from the fault to the first flag, in steps\n")
    print("| model | run | before (linear) | now | steps flagged now |")
    print("|---|---|---:|---:|---|")
    for kind in ("mlp", "attention"):
        for seed in range(args.seeds):
            for line in rows(kind, seed, args.steps, trigger):
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
