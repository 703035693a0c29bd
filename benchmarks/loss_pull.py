"""Does the loss ask a layer to grow? The sign of ``sum(y * dL/dy)`` on the fault sweep's prediction layers.

For a module's output ``y``, ``s = sum(y * dL/dy)`` is ``dL/dc`` at ``c = 1`` for the output
scaled by ``c``: below 0 the loss wants the output larger, above 0 smaller. For a Linear or a
convolution (``y = W x + b``, linear in its parameters) it is ``<W, dL/dW> + <b, dL/db>``, read
here from the parameters' gradients (no activation hook). A layer that grows because training
pushes it has ``s < 0``; a fault that makes it overshoot has ``s > 0`` while it grows on.

Each case is trained as ``benchmarks/fault_sweep.py`` does (the same recipe, batches and fault),
with one more callback that takes ``s`` of ``--module`` at each logged step, and prints, per
case: the logged steps the judge named the module at, the signs of ``s`` there, and, from the
onset, the first logged step where ``s > 0`` and where its last 3 logged values were all > 0.

    python benchmarks/loss_pull.py --model mlp --optimizer sgd --lr 0.02 --target 10 \\
        --cases healthy ramp:100 ramp:60 jump:100
    python benchmarks/loss_pull.py --model lstm --module model.net.head --seed 2 --cases healthy
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from typing import Any, Optional

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import fault_zoo  # noqa: E402
from benchmarks.fault_sweep import Variant, register  # noqa: E402


class Pull(pl.Callback):
    """At each logged step, ``sum(<p, dL/dp>)`` over ``module``'s own parameters (its output's ``sum(y * dL/dy)``)."""

    def __init__(self, module: str, every: int) -> None:
        self.prefix, self.every, self.pulls = module + ".", every, {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Take ``s`` on a logged step (as Lightning logs: ``(n + 1) % every == 0``)."""
        if (trainer.global_step + 1) % self.every:
            return
        own = [(p, p.grad) for name, p in pl_module.named_parameters()
               if name.startswith(self.prefix) and "." not in name[len(self.prefix):] and p.grad is not None]
        self.pulls[trainer.global_step] = float(sum((p.float() * g.float()).sum() for p, g in own))


def run(model: str, fault: Optional[str], onset: int, args: argparse.Namespace) -> tuple[Any, dict[int, float]]:
    """Train one case with the pull taken; its zoo case and the pulls by logged step."""
    pull = Pull(args.module, args.every)
    trainer = pl.Trainer

    def with_pull(*a: Any, callbacks: Any = (), **k: Any) -> pl.Trainer:
        return trainer(*a, callbacks=[*callbacks, pull], **k)

    fault_zoo.pl.Trainer = with_pull
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case = fault_zoo.run_case(model, fault, args.steps, onset, args.every, args.seed)
    finally:
        fault_zoo.pl.Trainer = trainer
    return case, pull.pulls


def first_positive(pulls: dict[int, float], onset: int, run_of: int) -> Optional[int]:
    """The first logged step from ``onset`` on where the last ``run_of`` logged pulls were all above 0."""
    steps = sorted(pulls)
    for i, step in enumerate(steps):
        if step >= onset and i + 1 >= run_of and all(pulls[s] > 0 for s in steps[i + 1 - run_of:i + 1]):
            return step
    return None


def describe(label: str, case: Any, healthy: Any, pulls: dict[int, float], module: str, onset: int) -> str:
    """One line: where the module was named, the pull's signs there, and when the pull turned."""
    named = sorted(s for s, rows in case.named.items() if any(r.startswith(module + " ") for r in rows))
    there = [pulls[s] for s in named if s in pulls]
    judged = [v for s, v in pulls.items() if s >= 47]
    line = (f"{label}: named at {len(there)} logged steps ({named[0] if named else '-'}-{named[-1] if named else '-'}),"
            f" s < 0 at {sum(v < 0 for v in there)} of them; s < 0 at {sum(v < 0 for v in judged)} of {len(judged)}"
            f" logged steps from 47 (median {statistics.median(judged):+.3g})")
    if case.fault != "healthy":
        turn = [first_positive(pulls, onset, n) for n in (1, 3)]
        line += (f"; from onset {onset}: s > 0 first at {turn[0]}, 3 in a row at {turn[1]};"
                 f" loss moved 5% at {fault_zoo.loss_moved(case, healthy)} steps after onset")
    return line


def main(argv: Optional[list[str]] = None) -> None:
    """Run the cases and print one line each."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--target", default="", help="the module every fault goes in, if not the recipe's own")
    parser.add_argument("--optimizer", default="", help="sgd, sgd-nesterov, adamw: if not the recipe's own")
    parser.add_argument("--lr", type=float, default=0.0)
    parser.add_argument("--module", default="model.10", help="the module whose pull is taken")
    parser.add_argument("--cases", nargs="+", default=["healthy"], help="healthy, or FAULT:ONSET (ramp:100)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = register(Variant("pull", args.model, (), target=args.target, optimizer=args.optimizer, lr=args.lr))
    healthy, pulls = run(model, None, args.steps, args)
    print(describe(f"{model} seed {args.seed} healthy", healthy, None, pulls, args.module, args.steps), flush=True)
    for spec in (c for c in args.cases if c != "healthy"):
        fault, onset = spec.split(":")
        case, pulls = run(model, fault, int(onset), args)
        print(describe(f"{model} seed {args.seed} {spec}", case, healthy, pulls, args.module, int(onset)), flush=True)


if __name__ == "__main__":
    main()
