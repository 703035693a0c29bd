"""Is a ramp named before the loss moved 5%, and could the loss itself say when to look? (issue 29)

For each seed: the recipe's healthy run and the same run with a ramp in its middle layer
(``benchmarks/fault_zoo.py``'s ``ramp``), judged by LayerHealth as the zoo does. Per pair: the ramp's
delay (steps from the onset to the culprit named), the layers named before it, the step the loss
moved 5% over the healthy twin's (the zoo's ``loss moved 5%``: a 3-step mean of the ratio, same
batches), the healthy run's verdict lines after 10%, and when the training loss left *its own*
recent range upward: the mean loss over each log interval (what a callback could accumulate on the
device between logged steps), on a log scale, above the median of its last 32 logged values by
more than ``--spread`` robust spreads (1.4826 x the median absolute deviation, floored at 5%), at
2 logged points in a row (one hard batch is not a move). That is the trigger a loss-aware
attribution would need ("the loss left its range: name the layer whose gain moved most"): if it
fires after the judge names the layer, or on the healthy twin, it cannot help.

    python benchmarks/ramp_vs_loss.py                                  # the MLP, seeds 0-6, logged every 2
    python benchmarks/ramp_vs_loss.py --model mlp --seeds 3 --onset 150 --every 5 --steps 240 --growth 1.015
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._zoo_models import RECIPES  # noqa: E402
from benchmarks.fault_zoo import judge_case, run_case  # noqa: E402


def loss_left_range(losses: list[float], every: int, spread: float, start: int, window: int = 32,
                    least: int = 24, floor: float = math.log(1.05)) -> list[int]:
    """The logged steps from ``start`` on at which the interval-mean loss was above its own range, 2 points in a row."""
    history: list[float] = []
    hits, run, last = [], 0, -1
    for step in range(every - 1, len(losses), every):
        x = math.log(statistics.fmean(losses[last + 1:step + 1]))
        last = step
        if len(history) >= least:
            recent = history[-window:]
            level = statistics.median(recent)
            noise = max(floor, 1.4826 * statistics.median(abs(v - level) for v in recent))
            run = run + 1 if x - level > spread * noise else 0
            if run >= 2 and step >= start:
                hits.append(step)
        history.append(x)
    return hits


def main(argv: Optional[list[str]] = None) -> None:
    """Print one markdown line per seed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=sorted(RECIPES))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(7)))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--onset", type=int, default=100)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--growth", type=float, default=1.04)
    parser.add_argument("--spread", type=float, default=3.0, help="robust spreads above its level the loss must be")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| model | seed | every | growth | ramp named at (before it) | loss moved 5% at | healthy lines after 10% |"
          " loss left its own range: ramp run | healthy run (after 10%) |")
    print("|---|---:|---:|---:|---|---:|---:|---|---|")
    for seed in args.seeds:
        healthy = run_case(args.model, None, args.steps, args.onset, args.every, seed)
        case = run_case(args.model, "ramp", args.steps, args.onset, args.every, seed, growth=args.growth)
        row, quiet = judge_case(case, healthy), judge_case(healthy, None)
        ramp_out = [s - args.onset for s in loss_left_range(case.losses, args.every, args.spread, args.onset)]
        healthy_out = loss_left_range(healthy.losses, args.every, args.spread, args.steps // 10)
        print(f"| {args.model} | {seed} | {args.every} | {args.growth} | {row['delay']} ({row['before']}) |"
              f" {row['loss5']} | {quiet['alarms']} | {ramp_out[0] if ramp_out else 'never'} |"
              f" {len(healthy_out)} points{f' (first at step {healthy_out[0]})' if healthy_out else ''} |", flush=True)


if __name__ == "__main__":
    main()
