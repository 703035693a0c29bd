"""The fault zoo: does LayerHealth name the layer that went wrong, first, and soon enough?

One fault is injected into one module in the middle of a small real network at a known step
(``--onset``), so that upstream and downstream layers exist; the run is watched by the package's
own ActivationMonitor, GradientMonitor(update_ratio=True) and LayerHealth, and a probe notes, at
every step, the layers the verdict names (in the order it lists them). Per case it reports the
layer named first, the delay from the onset to the step the culprit is first named, the layers
named before it, the step the loss moved 5% from where the same run without the fault is, and
the flight record's leader (read ``--flight`` steps after the onset). On the healthy recipes
every verdict line after the first 10% of the run is a false alarm.

Faults: ``ramp`` (the module's output grows 4% a step), ``jump`` (x20 at once), ``dead`` (its
output becomes 0), ``vanish`` (its weights shrunk 1000x once), ``lr100`` (its param group's LR
x100), ``attn`` (one block's queries grow 4% a step: its attention logits grow), ``nan`` (one NaN
in its output, once: at the first logged step from the onset where the module runs, the case's onset
then; never run after the onset, never born, graded as missed), ``data`` (the batch goes bad: its inputs x30,
the LMs' embedded tokens x30),
``gradvanish`` (the gradient reaching the ``vanish`` module's output x1e-6 from the onset: a cut in the
backward pass; its run watches output gradients, ``ActivationMonitor(gradients=True)``, as every
run does with ``--gradients``).
Healthy runs: each recipe without a fault, and on a recipe with a cyclic LR ``swing``: the module's
output scale swings with the LR, x1.3 at its peak and /1.3 at its trough (a layer whose activations
follow the LR, as a cyclic schedule makes them): no verdict.

    python benchmarks/fault_zoo.py                      # the whole zoo, a table
    python benchmarks/fault_zoo.py --models gpt2 --faults ramp jump --steps 200
    python benchmarks/fault_zoo.py --models mlp gpt2 --faults healthy gradvanish jump --gradients
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import Logger
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._zoo_models import RECIPES, Recipe, schedule  # noqa: E402
from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth  # noqa: E402
from lightning_hooks.callbacks._flight_leader import OutputLevels, output_levels  # noqa: E402
from lightning_hooks.callbacks._flight_recorder import analyse  # noqa: E402
from lightning_hooks.output.figures import FigureListener  # noqa: E402

FAULTS = ("ramp", "jump", "dead", "vanish", "lr100", "attn", "nan", "data", "gradvanish")
#: Optimizers the sweep's ``unseen4`` adds (each at a constant LR): RMSprop, Adagrad, SGD without momentum, Adafactor.
OTHER_OPTIMIZERS = {"rmsprop": lambda groups, lr: torch.optim.RMSprop(groups, lr=lr),
                    "adagrad": lambda groups, lr: torch.optim.Adagrad(groups, lr=lr),
                    "plain-sgd": lambda groups, lr: torch.optim.SGD(groups, lr=lr),
                    "adafactor": lambda groups, lr: torch.optim.Adafactor(groups, lr=lr),
                    "radam": lambda groups, lr: torch.optim.RAdam(groups, lr=lr),  # the sweep's unseen15
                    "nadam": lambda groups, lr: torch.optim.NAdam(groups, lr=lr),
                    "adamax": lambda groups, lr: torch.optim.Adamax(groups, lr=lr)}
HEALTHY = ("healthy", "swing")  # runs without a fault: every verdict line after the first 10% is a false alarm
# faults carried by a forward hook on the culprit: none happens where the model never calls it as a module (say
# ``nn.MultiheadAttention``'s ``out_proj``, used by its weights); ``vanish`` and ``lr100`` act on its weights.
# ``OUTPUT``: those that change its output (``Lit._hurt``); ``gradvanish`` cuts the gradient reaching it
OUTPUT = ("ramp", "jump", "dead", "nan", "attn", "swing")
HOOKED = (*OUTPUT, "gradvanish")
# faults that change the culprit's output at once, from the first call from the onset on: their onset is that call's
# step (a top-1 MoE's expert routed no token at the nominal onset is hurt when first routed one; the figures see it
# then, and no detector can sooner)
ABRUPT = ("jump", "dead")
GROWTH, JUMP, SHRINK, LR_FACTOR, DATA_SCALE, SWING, GRAD_CUT = 1.04, 20.0, 1e-3, 100.0, 30.0, 1.3, 1e-6


class Lit(pl.LightningModule):
    """A recipe's model, trained as the recipe says, with one fault injected from step ``onset``."""

    def __init__(self, recipe: Recipe, fault: Optional[str], onset: int, steps: int, seed: int, every: int,
                 growth: float = GROWTH, hold: int = 0) -> None:
        super().__init__()
        self.every, self.growth, self.hold = every, growth, hold
        torch.manual_seed(seed)
        self.recipe, self.fault, self.onset, self.steps = recipe, fault, onset, steps
        self.fired: Optional[int] = None  # the step the NaN was born at (``nan``)
        self.hurt = 0  # training calls of the culprit from the onset on: 0, a fault carried by its hook never happened
        self.first_ran: Optional[int] = None  # the first step from the onset on that called the culprit
        self.model = recipe.build()
        self.draw = recipe.data(seed, recipe.batch)
        target = recipe.targets.get({"gradvanish": "vanish", "swing": "ramp"}.get(fault or "", fault or ""))
        self.culprit = "model." + target if target else ""
        self.mult = schedule(recipe, steps)
        if self.culprit and fault in HOOKED:
            self.get_submodule(self.culprit).register_forward_hook(self._count)
        if self.culprit and fault in OUTPUT:
            self.get_submodule(self.culprit).register_forward_hook(self._hurt)
        if fault == "gradvanish":
            self.get_submodule(self.culprit).register_forward_hook(self._cut)
        if fault == "data" and recipe.loss == "lm":  # the batch's embedded tokens out of range, x30
            self.model.net.get_input_embeddings().register_forward_hook(self._bad_batch)
        self.thaw = int(recipe.thaw * steps) if recipe.frozen and recipe.thaw else -1
        if recipe.frozen:  # the sweep's unseen15: a module that does not train (until ``thaw``)
            self.model.get_submodule(recipe.frozen).requires_grad_(False)

    def _step(self) -> int:
        return self.trainer.global_step

    def _count(self, module: nn.Module, args: Any, out: Any) -> None:
        ran = self.training and self._step() >= self.onset
        self.hurt += ran
        if ran and self.first_ran is None:
            self.first_ran = self._step()

    def _bad_batch(self, module: nn.Module, args: Any, out: Tensor) -> Optional[Tensor]:
        return out * DATA_SCALE if self.training and self._step() >= self.onset else None

    def _cut(self, module: nn.Module, args: Any, out: Any) -> None:
        """The gradient reaching the output cut x1e-6 (before the monitor's own hook on it sees it)."""
        out = out[0] if isinstance(out, tuple) else out  # an RNN's (output, state): its output
        if self.training and self._step() >= self.onset and out.requires_grad:
            out.register_hook(lambda grad: grad * GRAD_CUT)

    def _hurt(self, module: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, tuple):  # an RNN's (output, state): the fault goes in its output
            hurt = self._hurt(module, args, out[0])
            return None if hurt is None else (hurt, *out[1:])
        t = self._step() - self.onset
        if self.fault == "swing" and self.training:  # in phase with the cyclic LR: largest where the LR is
            return out * SWING ** -math.cos(2 * math.pi * self._step() / self.recipe.cycle)
        if t < 0 or not self.training:
            return None
        if self.fault == "ramp":  # ``hold``: it grows for that many steps, then holds
            return out * self.growth ** (min(t, self.hold) if self.hold else t)
        if self.fault == "jump":
            return out * JUMP
        if self.fault == "dead":
            return out * 0.0
        if self.fault == "nan":  # born at the first logged step from the onset on where the module runs (an expert
            # routed no token at a step is not called): there the figures can see it; that step is the fault's onset
            if (self._step() + 1) % self.every or self.fired not in (None, self._step()):
                return None
            self.fired = self._step()
            out = out.clone(memory_format=torch.contiguous_format)  # an RNN's output may be a strided view
            out.view(-1)[0] = float("nan")
            return out
        out = out.clone()  # attn: the queries (GPT-2: the first third of c_attn's output) grow
        width = out.shape[-1] // 3 if out.shape[-1] % 3 == 0 and "c_attn" in self.culprit else out.shape[-1]
        out[..., :width] *= self.growth ** t
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        own = set(map(id, self.model.get_submodule(self.recipe.targets["lr100"]).parameters()))
        groups = [{"params": [p for p in self.model.parameters() if id(p) not in own]},
                  {"params": [p for p in self.model.parameters() if id(p) in own]}]
        name, lr = self.recipe.optimizer, self.recipe.lr
        if name.startswith("adamw"):  # "adamw-flat": a constant LR (``schedule``)
            return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
        if name.startswith("sgd"):  # "sgd-restarts": SGDR (``schedule``)
            return torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=self.recipe.weight_decay,
                                   nesterov=name == "sgd-nesterov")
        if name in OTHER_OPTIMIZERS:  # the sweep's unseen4: a constant LR
            return OTHER_OPTIMIZERS[name](groups, lr)
        return torch.optim.Adam(groups, lr=lr)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        step = self._step()
        if step == self.thaw:
            self.model.get_submodule(self.recipe.frozen).requires_grad_(True)
        for i, group in enumerate(self.optimizers().optimizer.param_groups):
            boost = LR_FACTOR if self.fault == "lr100" and i == 1 and step >= self.onset else 1.0
            group["lr"] = self.recipe.lr * self.mult(step) * boost
        if self.fault == "vanish" and step == self.onset and batch_idx % self.recipe.accumulate == 0:
            with torch.no_grad():  # its weights: an LSTM's are ``weight_ih_l0``, ``weight_hh_l0``...
                for name, param in self.get_submodule(self.culprit).named_parameters(recurse=False):
                    if name.startswith("weight"):
                        param.mul_(SHRINK)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        acc = self.recipe.accumulate  # with accumulation, each micro-batch is drawn apart
        x, y = self.draw(self._step() if acc == 1 else self._step() * acc + batch_idx % acc)
        if self.fault == "data" and self._step() >= self.onset and self.recipe.loss != "lm":
            x = x * DATA_SCALE
        out = self.model(x)
        if self.recipe.loss == "lm":
            loss = nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())
        elif self.recipe.loss == "ce":
            loss = nn.functional.cross_entropy(out.float(), y)
        else:
            loss = nn.functional.mse_loss(out.float(), y)
        self.log("loss", loss)
        return loss

    def train_dataloader(self) -> Any:
        return [0] * self.steps  # the batch is drawn from the step in training_step


class Probe(FigureListener, pl.Callback):
    """At every step: the loss, each parameter's gradient norm, and the layers LayerHealth names, in its order.

    At each logged step, the modules' output std, as GradientAnomalyStopping's flight recorder keeps them.
    """

    def __init__(self, health: LayerHealth) -> None:
        self.health = health
        self.levels: list[tuple[int, dict[str, float], dict[str, float]]] = []  # (log step, outputs, output grads)
        self.losses: list[float] = []
        self.norms: list[np.ndarray] = []
        self.names: list[str] = []
        self.named: dict[int, list[str]] = {}  # step -> layers named, in the summary's order

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = {n: p.grad for n, p in pl_module.named_parameters() if p.grad is not None}
        self.names = self.names or list(grads)  # the first step's: a switch-routed expert skipped at a step reads 0
        self.norms.append(np.array([float(grads[n].float().norm()) if n in grads else 0.0 for n in self.names]))

    def record_figures(self, figures: Any, metrics: Any, step: int) -> None:
        """Keep the modules' output std logged at ``step``, as the flight recorder does."""
        levels, grads = output_levels(figures), output_levels(figures, "activation_grads")
        if levels or grads:
            self.levels.append((step, levels, grads))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:  # a micro-batch that did not step
            return
        self.losses.append(float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs))
        verdicts = self.health.verdicts
        now = sorted(((p, layer, e) for (p, layer), e in verdicts.episodes.items() if e.ongoing), key=verdicts.order)
        self.named[trainer.global_step - 1] = list(dict.fromkeys(f"{layer} ({p})" for p, layer, _ in now))


@dataclass
class Case:
    """What one run of the zoo showed."""

    model: str
    fault: str
    culprit: str
    onset: int
    steps: int
    losses: list[float]
    named: dict[int, list[str]]
    leader: Optional[str] = None
    seconds: float = 0.0
    summary: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def run_case(model: str, fault: Optional[str], steps: int, onset: int, every: int, seed: int = 0,
             flight: int = 30, logger: Optional[Logger] = None, gradients: bool = False,
             growth: float = GROWTH, hold: int = 0) -> Case:
    """Train one case and return what the verdicts said at each step.

    ``logger`` (say a ``TensorBoardLogger``) receives the monitors' figures and the loss, for the
    Layers tab; by default nothing is written. ``gradients``: watch the gradient reaching each
    module's output too (always for ``gradvanish``).
    """
    recipe = RECIPES[model]
    start = time.perf_counter()
    lit = Lit(recipe, fault, onset, steps, seed, every, growth, hold)
    health = LayerHealth()
    probe = Probe(health)
    watch = ActivationMonitor(histogram=False, gradients=gradients or fault == "gradvanish")
    callbacks = [watch, GradientMonitor(histogram=False, update_ratio=True), health, probe]
    trainer = pl.Trainer(max_steps=steps, logger=logger or False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=every, callbacks=callbacks,
                         precision=recipe.precision, gradient_clip_val=recipe.clip or None,
                         accumulate_grad_batches=recipe.accumulate, accelerator="cpu", devices=1,
                         num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(lit)
    onset = lit.fired if lit.fired is not None else onset  # a NaN born after the onset, where the module first ran
    if fault in ABRUPT and lit.first_ran is not None:  # an expert routed no token at the onset: hurt when first called
        onset = lit.first_ran
    case = Case(model, fault or "healthy", lit.culprit, onset, steps, probe.losses, probe.named,
                seconds=time.perf_counter() - start, summary=health.summary())
    case.extra["fault_ran"] = fault not in HOOKED or lit.hurt > 0
    if fault and probe.norms:
        flight_leaders(case, probe, onset, flight)
    return case


def flight_leaders(case: Case, probe: Probe, onset: int, flight: int) -> None:
    """The flight record's leader ``flight`` steps after the onset (64 steps): from outputs, and from gradients only.

    ``case.leader`` is what the record says (outputs where logged); ``extra["gradient_leader"]``
    what gradient norms alone say (the record before it read outputs), with its tie's size.
    """
    end = min(onset + flight, len(probe.norms))
    rows = np.stack(probe.norms[max(0, end - 64):end])
    steps, losses = list(range(end - len(rows), end)), probe.losses[end - len(rows):end]
    outputs = OutputLevels(64)
    for step, levels, grads in probe.levels:
        if steps[0] <= step < end:
            outputs.add(step, levels, grads)
    record = analyse(end - 1, steps, losses, rows, probe.names, outputs)
    case.leader = "(every layer)" if record.data else record.leader
    case.extra.update(judged_by=record.judged_by, ties=len(record.tied) + (record.leader is not None))
    alone = analyse(end - 1, steps, losses, rows, probe.names)
    case.extra.update(gradient_leader="(every layer)" if alone.data else alone.leader,
                      gradient_ties=len(alone.tied) + (alone.leader is not None))


def is_culprit(named: str, culprit: str) -> bool:
    """Whether a named row (``layer (problem)``) is the culprit module, one of its parameters or submodules."""
    layer = named.rsplit(" (", 1)[0]
    return layer == culprit or layer.startswith(culprit + ".")


def judge_case(case: Case, healthy: Optional[Case]) -> dict[str, Any]:
    """The row of the table: first named, delay, named before the culprit, loss moved 5%, the flight leader."""
    quiet_from = case.steps // 10
    steps = sorted(s for s in case.named if s >= quiet_from)
    first_step = next((s for s in steps if case.named[s]), None)
    row: dict[str, Any] = {"model": case.model, "fault": case.fault, "onset": case.onset, "s": round(case.seconds, 1)}
    if not case.extra.get("fault_ran", True):  # recorded before it was kept: every fault ran
        row["ran"] = False
    if case.fault in HEALTHY:
        lines = sorted({n for s in steps for n in case.named[s]})
        row.update(alarms=len(lines), lines=lines[:6], first_alarm=first_step)
        return row
    first = case.named[first_step][0] if first_step is not None else None
    if case.fault == "data":
        at = next((s for s in steps if s >= case.onset and case.named[s]), None)
        row.update(first=first, first_step=first_step, delay=None if at is None else at - case.onset,
                   named_at_once=len(case.named[at]) if at is not None else 0)
    else:
        hit = next((s for s in steps if s >= case.onset and any(is_culprit(n, case.culprit) for n in case.named[s])),
                   None)
        before: list[str] = []
        for s in steps:
            for n in case.named[s]:
                if s == hit and is_culprit(n, case.culprit):
                    break
                if not is_culprit(n, case.culprit) and n not in before:
                    before.append(n)
            if s == hit:
                break
        row.update(first=first, delay=None if hit is None else hit - case.onset, before=len(before),
                   before_names=before[:3])
    row["loss5"] = loss_moved(case, healthy)
    row["leader"], row["ties"], row["judged_by"] = case.leader, case.extra.get("ties"), case.extra.get("judged_by")
    row["gradient_leader"], row["gradient_ties"] = case.extra.get("gradient_leader"), case.extra.get("gradient_ties")
    return row


def loss_moved(case: Case, healthy: Optional[Case], rel: float = 0.05, smooth: int = 3) -> Optional[int]:
    """Steps from the onset until the loss is 5% above the same run's without the fault (a trailing 3-step mean).

    The same seed draws the same batches, so the ratio of the two losses is free of minibatch
    noise; a non-finite loss has moved. None if it never moved.
    """
    if healthy is None:
        return None
    a, b = np.array(case.losses), np.array(healthy.losses)
    for s in range(case.onset, min(len(a), len(b))):
        ratio = a[max(case.onset, s - smooth + 1):s + 1] / b[max(case.onset, s - smooth + 1):s + 1]
        if not np.isfinite(ratio).all() or ratio.mean() > 1 + rel:
            return s - case.onset
    return None


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """Run the chosen cases and print one line per case (a markdown table)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama", "cnn", "mlp", "mlp-cyclic"],
                        choices=sorted(RECIPES))
    parser.add_argument("--faults", nargs="+", default=[*HEALTHY, *FAULTS], choices=[*HEALTHY, *FAULTS])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--onset", type=int, default=100)
    parser.add_argument("--every", type=int, default=2, help="log every this many steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--growth", type=float, default=GROWTH, help="the ramps' factor per step")
    parser.add_argument("--verbose", action="store_true", help="print LayerHealth's summary of each case")
    parser.add_argument("--gradients", action="store_true", help="every run watches output gradients too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print("| model | fault | first named | delay | named before culprit | loss moved 5% | flight leader, gradients"
          " only (tie) | flight leader (judged by) | s |")
    print("|---|---|---|---:|---:|---:|---|---|---:|")
    for model in args.models:
        healthy = run_case(model, None, args.steps, args.onset, args.every, args.seed, gradients=args.gradients)
        for fault in args.faults:
            if (fault == "attn" and RECIPES[model].loss != "lm") or (fault == "swing" and not RECIPES[model].cycle):
                continue
            case = healthy if fault == "healthy" else run_case(model, fault, args.steps, args.onset, args.every,
                                                               args.seed, gradients=args.gradients,
                                                               growth=args.growth)
            row = judge_case(case, healthy)
            rows.append(row)
            print(format_row(row), flush=True)
            if args.verbose:
                print(case.summary)
    return rows


def format_row(row: dict[str, Any]) -> str:
    """One markdown table line."""
    if row["fault"] in HEALTHY:
        lines = "; ".join(row["lines"]) + (" ..." if row["alarms"] > len(row["lines"]) else "")
        found = f" (first at step {row['first_alarm']}): {lines}" if row["alarms"] else ""
        said = f"{row['alarms']} verdict lines after 10%{found}"
        return f"| {row['model']} | {row['fault']} | {said} | | | | | | {row['s']} |"
    before = row.get("before")
    said = f"{before} ({'; '.join(row['before_names'])})" if before else ("-" if before is None else "0")
    if row["fault"] == "data":
        said = f"{row['named_at_once']} named at once"
    return (f"| {row['model']} | {row['fault']} | {row['first']} | {row['delay']} | {said} | {row['loss5']} | "
            f"{row['gradient_leader']} ({row['gradient_ties']}) | {row['leader']} ({row['judged_by']}) | {row['s']} |")


if __name__ == "__main__":
    main()
