"""Could the training loss tell the judge when a very slow ramp matters? Measured on recorded cases (issue 29).

A ramp under the judge's rate limit (docs/verdicts.md, "Very slow ramps") leans its module's gain
steadily, as healthy rows of other runs do; the idea tried here: name such a leaning module only
while the loss is getting worse. Read from ``benchmarks/judge_replay.py`` recordings, per slow ramp
(``--max-growth``, on ``--model``): the faulty run's own training loss at the steps LayerHealth
would see it (its logged steps, as the monitors log: ``every - 1``, ``2 every - 1`` …), the value
``outputs["loss"]`` of that step, as the zoo's probe kept it. Three measures, log scale:

- ``rise``: its mean over the last ``--points`` logged points against its median over the 20 logged
  points before the onset, at the step the zoo says "the loss moved 5%", and the largest after the
  onset (a rule "the loss rose by a margin" cannot fire below 0), with the pre-onset robust spread
  of one point and of a ``--points`` mean;
- ``trend``: its mean residual over the last ``--points`` points against a line fitted to the 40
  logged points before the onset, in standard errors: the largest up to the 5% step, and on the
  healthy twin after the onset (training slows down, so the twin's loss leaves its trend upward too);
- ``twin``: what "the loss moved 5%" is: the ratio to the healthy twin's loss (same batches), a
  3-step mean (the zoo's) and a 16-step mean at that step; the run itself never sees the twin.

``--late``: instead, every gradual fault (a ramp, a raised LR …, on any model) whose culprit was
named after the loss moved 5%, or never: where a loss-aware rule would have to help.

    python benchmarks/slow_ramp_loss.py /work/rec4/creep_s0.pkl /work/rec4/creep_s1.pkl
    python benchmarks/slow_ramp_loss.py --late /work/rec*/*.pkl
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pct(log_ratio: float) -> str:
    """A log ratio as a signed percentage."""
    return f"{100 * (np.exp(log_ratio) - 1):+.1f}%"


def rise(loss: np.ndarray, logged: np.ndarray, onset: int, at: Optional[int], points: int) -> str:
    """The loss's mean over the last ``points`` logged points against its pre-onset median, at ``at`` and at most."""
    pre = logged[logged < onset][-20:]
    base = float(np.median(loss[pre]))
    spread = 1.4826 * float(np.median(np.abs(loss[pre] - base)))
    levels = {int(s): float(np.mean(loss[logged[(logged <= s) & (logged > s - points * (logged[1] - logged[0]))]]))
              for s in logged[logged >= onset]}
    seen = [s for s in levels if at is not None and s <= at]  # the logged points by the 5% step
    here = pct(levels[max(seen)] - base) if seen else "-"
    return (f"rise at 5% {here}, largest {pct(max(levels.values()) - base)} (one point's spread {pct(spread)},"
            f" a {points}-point mean's {pct(spread / np.sqrt(points))})")


def trend_z(loss: np.ndarray, logged: np.ndarray, onset: int, until: int, points: int) -> float:
    """The largest mean residual of ``points`` points over the pre-onset trend, in standard errors, to ``until``."""
    pre = logged[logged < onset][-40:]
    slope, cut = np.polyfit(pre, loss[pre], 1)
    noise = float(np.std(loss[pre] - (slope * pre + cut), ddof=2))
    width = points * (logged[1] - logged[0])
    windows = [logged[(logged <= s) & (logged > s - width)] for s in logged[(logged >= onset) & (logged <= until)]]
    return max((float(np.mean(loss[w] - (slope * w + cut)) / (noise / np.sqrt(len(w)))) for w in windows),
               default=float("nan"))


def measure(case: Any, healthy: Any, row: dict[str, Any], points: int) -> str:
    """One slow ramp's line: the three measures of the module docstring."""
    every = row.get("every", 2)
    logged = np.arange(every - 1, case.steps, every)
    loss, twin = np.log(np.array(case.losses)), np.log(np.array(healthy.losses))
    moved = row.get("loss5")
    at = None if moved is None else case.onset + moved
    paired = loss - twin
    paired3 = max(np.mean(paired[s - 2:s + 1]) for s in range(case.onset + 2, case.steps))
    paired16 = pct(float(np.mean(paired[at - 15:at + 1]))) if at is not None else "-"
    return (f"x{row.get('growth', 'zoo')} from {case.onset}, loss moved 5% at {moved}:"
            f" {rise(loss, logged, case.onset, at, points)};"
            f" trend: ramp {trend_z(loss, logged, case.onset, at or case.steps, points):.1f} SE,"
            f" healthy twin {trend_z(twin, logged, case.onset, case.steps, points):.1f} SE;"
            f" twin ratio: 3-step largest {pct(paired3)}, 16-step at 5% {paired16}")


#: Faults the judge must name at the first logged step (abrupt), or not on one layer: not for ``--late``.
ABRUPT = ("healthy", "data", "jump", "dead", "nan", "vanish")


def chosen(case: Any, healthy: Any, row: dict[str, Any], args: argparse.Namespace) -> bool:
    """Whether the case is measured: a slow ramp on ``--model``, or with ``--late`` any gradual fault named late."""
    if not args.late:
        return case.model == args.model and case.fault == "ramp" and row.get("growth", 2.0) <= args.max_growth
    moved, delay = row.get("loss5"), row.get("delay")
    late = delay is None or delay > moved or not row.get("culprit_first", True) if moved is not None else False
    return case.fault not in ABRUPT and healthy is not None and late and np.all(np.isfinite(case.losses[:case.onset]))


def main(argv: Optional[list[str]] = None) -> None:
    """Print one line per slow ramp in the recordings given."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="benchmarks/judge_replay.py recordings")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--max-growth", type=float, default=1.01, help="ramps at most this growth a step")
    parser.add_argument("--points", type=int, default=16, help="logged points the loss is averaged over")
    parser.add_argument("--late", action="store_true", help="every gradual fault named after the loss moved 5%%")
    args = parser.parse_args(argv)
    for path in args.paths:
        for case, healthy, row in pickle.loads(Path(path).read_bytes()):
            if chosen(case, healthy, row, args):
                print(f"{Path(path).name} {row.get('variant', case.model)} {case.fault} named at {row.get('delay')}"
                      f" {measure(case, healthy, row, args.points)}")


if __name__ == "__main__":
    main()
