"""Where the gradient check's step goes, line by line: a copy of the tree with checkpoints, in a real fit.

``not_logged_breakdown.py`` times whole functions; this copies ``lightning_hooks`` (of this tree, or of
``--tree``) into a temporary folder, inserts a checkpoint after (or before) each line named in ``POINTS``
(a line that is not found is left out, and said), and fits ``D x Linear(64, 64)`` with the Quick start's
three callbacks (never logging) beside plain training, in turns. Each checkpoint keeps the thread's CPU
time since the one before it (a step's checkpoints run in order: from the start of
``GradientCheck.on_before_optimizer_step`` to its end), so the parts add up to the hook; each hook of
the three callbacks is timed whole as well (``not_logged_breakdown``'s wrappers). Printed: microseconds
per optimizer step, the mean over the timed steps. A checkpoint costs about 1 us (two clock reads and a
look-up), part of each figure.

    python benchmarks/not_logged_lines.py --depth 10
    python benchmarks/not_logged_lines.py --depth 100 --tree /path/to/an/older/checkout
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
T = "__import__('_not_logged_ticks')"

#: Per file: (text of the line, label, "after" or "before" it); "|" separates texts any one of which will do.
POINTS = {
    "callbacks/_gradient_check.py": [
        ("shared = self._shared if self._shared", "start", "before"),
        ("read = shared.read(trainer, optimizer, self)", "read: the measurement, or the reader's part", "after"),
        ("self._handle(trainer, pl_module, optimizer, *read)", "reader's _handle", "after"),
        ("self._stepped = True", "hook's end", "after"),
    ],
    "distributed/_shared_measurement.py": [
        ("token = (id(optimizer), trainer.global_step)", "token (global_step)", "after"),
        ("self.finish()", "finish (nothing pending)", "after"),
        ("readers = [r for r in self.readers if r._checks", "readers that check", "after"),
        ("self._results = {id(r): (token, None)", "results reset", "after"),
        ("detectors = [r._detector for r in readers]", "detectors", "after"),
        ("steps = measure_step(trainer, optimizer, detectors, self._shard_groups, exact=False)",
         "measure_step's return", "after"),
        ("votes = [r._votes(trainer, step)", "votes", "after"),
        ("extras = [r._extra(trainer, step)", "extras (is the step logged)", "after"),
        ("agreed = agree(trainer, detectors, steps, extras, votes)", "agree (transfer started)", "after"),
        ("checks = agreed.checks(remember)", "may every reader wait", "before"),
        ("checks = agreed.checks(remember)", "checks' return", "after"),
        ("self._results.update({id(r): (token, (step, check))", "results kept", "after"),
    ],
    "distributed/_step_measure.py": [
        ("params, grads, sizes = _params_with_grads(optimizer)", "gather the gradients (.grad, .layout)", "after"),
        ("overflow = _amp_overflow(trainer, optimizer, device)", "device, AMP scaler", "after"),
        ("key = next((i for i, opt in enumerate(trainer.optimizers)|key = _index(trainer.optimizers, optimizer)",
         "figures' return, optimizer's index", "after"),
        ("return [Step(key, params, figures, None, None, None) for _ in detectors]", "flags on the host?", "before"),
    ],
    "measure/_gradient_figures.py": [
        ("device = grads[0].device if device is None else device|its arguments checked, under",
         "shard groups, call, checks, no_grad", "after"),
        ("found, narrow = _foreach_norms(parts, 2.0)", "READ: _foreach_norm", "after"),
        ("norms = _stacked(found, device, None if narrow", "READ: stack", "after"),
        ("total = torch.linalg.vector_norm(norms, dtype=f64)", "total: vector_norm (float64)", "after"),
    ],
    "distributed/_rank_agreement.py": [
        ("return self._checks_on_host(self.transfer.read(arrays), remember)", "checks: names", "before"),
        ("norms, checks = host[\"norms\"], []", "transfer read", "after"),
        ("checks.append(Check(dict(flags), None, norms", "host flags, a Check per reader", "after"),
    ],
}

TICKS = '''import collections, time
_clock = time.thread_time_ns
_last = [0]
SUMS = collections.defaultdict(int)
ORDER = []
def tick(label, start=False):
    now = _clock()
    if not start:
        if label not in SUMS:
            ORDER.append(label)
        SUMS[label] += now - _last[0]
    _last[0] = _clock()
'''


def instrument(tree: Path, out: Path) -> list[str]:
    """Copy ``tree``'s package into ``out`` with the checkpoints; return the points not found."""
    shutil.copytree(tree / "lightning_hooks", out / "lightning_hooks")
    (out / "_not_logged_ticks.py").write_text(TICKS)
    missing = []
    for path, points in POINTS.items():
        file = out / "lightning_hooks" / path
        lines = file.read_text().split("\n")
        for text, label, where in points:
            index = next((i for i, line in enumerate(lines) if any(t in line for t in text.split("|"))), None)
            if index is None:
                missing.append(f"{path}: {label}")
                continue
            indent = re.match(r"\s*", lines[index]).group(0)
            call = f"{T}.tick({label!r}, start=True)" if label == "start" else f"{T}.tick({label!r})"
            lines.insert(index + (where == "after"), indent + call)
        file.write_text("\n".join(lines))
    return missing


def run(depth: int, steps: int, rounds: int) -> None:
    """In the instrumented copy: fit plain and with the three, in turns; print each part per step."""
    sys.path.insert(0, str(HERE))
    import _not_logged_ticks as ticks
    import not_logged_breakdown as nb
    import torch

    from lightning_hooks import ActivationMonitor, GradientAnomalyStopping, GradientMonitor

    torch.set_num_threads(1)
    for cls in (ActivationMonitor, GradientMonitor, GradientAnomalyStopping):  # the hooks alone: no wrapper in a part
        for hook in nb.HOOKS:
            nb._wrap(cls, hook, f"{cls.__name__}.{hook}")

    for r in range(rounds):
        plain = nb._fit(depth, list, steps)
        nb.TIMES.clear()
        ticks.SUMS.clear()
        three = nb._fit(depth, nb.quick_start, steps)
        print(f"round {r}: plain {plain:.0f} us, the three {three:.0f} us a step (median CPU)")
    n = len(nb.TIMES["GradientMonitor.on_before_optimizer_step"])
    print(f"\n{'part (in step order)':56s} us a step")
    for label in ticks.ORDER:
        print(f"{label:56s} {ticks.SUMS[label] / n / 1e3:8.1f}")
    print(f"\n{'hook (timed whole)':56s} us a step")
    for label in sorted(nb.TIMES, key=lambda k: -sum(nb.TIMES[k])):
        print(f"{label:56s} {sum(nb.TIMES[label]) / n * 1e6:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tree", default=str(HERE.parent), help="the checkout whose package is instrumented")
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run(args.depth, args.steps, args.rounds)
        return
    out = Path(tempfile.mkdtemp(prefix="not_logged_lines_"))
    try:
        for missing in instrument(Path(args.tree).resolve(), out):
            print(f"not found, left out: {missing}")
        env = dict(os.environ, PYTHONPATH=str(out), OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, __file__, "--run", "--depth", str(args.depth), "--steps", str(args.steps),
                        "--rounds", str(args.rounds)], env=env, cwd=out, check=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
