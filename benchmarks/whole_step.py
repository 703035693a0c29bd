"""The whole training step, before and after, beside the A/A noise: each configuration in its own process.

A worker process per configuration and source tree (``--before`` points at a checkout of an older
commit, run with its own ``PYTHONPATH``) stays up for the whole sitting and runs one fit when told
to, so a configuration never shares a Python heap, an allocator or a garbage collector with
another, and the start-up of a process (half a minute on a loaded 2-core machine) is paid once.
The coordinator runs the fits one at a time in interleaved rounds (plain training first, last and
after every two others, in a shuffled order: ``harness.round_order``) on ``D x Linear(64, 64)``
and the GPT-2-style decoder of ``scaling.py``, and reports each fit's median step (wall, and the
process's CPU time, TensorBoard's writer thread included) over the plain fits on either side of it.
"plain (A/A)" is plain training in a process of its own: its ratio is the noise floor. "three empty
callbacks" is plain training with three callbacks that do nothing: what Lightning's calls into three
callbacks' hooks cost, whatever the callbacks do (the floor of the Quick start's three).

    python benchmarks/whole_step.py --before /work/wt-perf-before
    python benchmarks/whole_step.py --depths 10,100 --no-decoder --rounds 2     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
NEVER = 10**9  # a log interval no fit reaches: only step 0 could log, and it is a warm-up step
MARK = "@@whole_step "  # a worker's reply line; Lightning writes to the same stdout
BASELINES = ("plain (A/A)", "three empty callbacks")  # one side only: no code of the package runs
CONFIGS = ("quick start, not logged", "quick start, logged", "ActivationMonitor, not logged",
           "ActivationMonitor, logged")


def _callbacks(name: str) -> list[Any]:
    """The callbacks of configuration ``name``: the Quick start's three, or ActivationMonitor alone.

    ``max_rows=None``: GradientMonitor's default limit (1,000 rows) refuses the 2,000 parameters of
    the 1,000-layer stack before training.
    """
    from lightning_hooks import ActivationMonitor, GradientAnomalyStopping, GradientMonitor

    if name == "three empty callbacks":
        from lightning.pytorch import Callback

        return [type(f"Empty{i}", (Callback,), {})() for i in range(3)]  # three classes: three state keys
    every = 1 if name.endswith(", logged") else NEVER
    if name.startswith("quick start"):
        return [ActivationMonitor(log_every_n_steps=every, max_rows=None),
                GradientMonitor(log_every_n_steps=every, max_rows=None), GradientAnomalyStopping(action="skip")]
    if name.startswith("ActivationMonitor"):
        return [ActivationMonitor(log_every_n_steps=every, max_rows=None)]
    return []


def _gradient_read(model: Any) -> float:
    """Seconds for one read of the model's gradients, as the check makes it (best of 21)."""
    import torch

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    times = []
    for _ in range(21):
        start = time.perf_counter()
        torch.stack(torch._foreach_norm(grads))
        times.append(time.perf_counter() - start)
    return min(times)


def worker(name: str, threads: int) -> None:
    """Run one fit of ``name`` per line read (``model steps warmup``), and reply with its step times."""
    import torch

    sys.path.insert(0, str(HERE))
    from harness import Config, StepTimer, Workload, run_fit
    from scaling import hooked_modules, workloads

    torch.set_num_threads(threads)
    config = Config(name, name, lambda tmp: _callbacks(name))
    tmp = tempfile.mkdtemp(prefix="whole_step_")
    import lightning_hooks
    import lightning_hooks.output.sinks as sinks

    if os.environ.get("WHOLE_STEP_TENSORBOARD_CHECKSUM") and hasattr(sinks, "speed_up"):
        sinks.speed_up = lambda event_writer: None  # an older tree: its records checksummed by TensorBoard's loop

    print(MARK + json.dumps({"source": lightning_hooks.__file__}), flush=True)  # which tree this process runs
    for count, line in enumerate(sys.stdin):
        kind, steps, warmup = line.split()
        depth = int(kind[5:]) if kind.startswith("stack") else 0
        built = workloads([depth] if depth else [], not depth)[kind]
        model = built.model()
        workload = Workload(lambda m=model: m, built.batches)
        timer = StepTimer(int(warmup), 5, 6.0)  # a slow configuration stops after 4 timed steps past 6 s
        run_fit(workload, config, int(warmup) + int(steps) + 1, tmp, f"{kind}-{count}", extra=[timer])
        timed = timer.durations(int(warmup))
        reply = {"wall": statistics.median(s[1] for s in timed), "cpu": statistics.median(s[2] for s in timed),
                 "steps": len(timed)}
        if name == "plain":  # plain training: what a module and a read cost
            reply["read"] = _gradient_read(model)
            reply["modules"] = hooked_modules(built)
        print(MARK + json.dumps(reply), flush=True)


class Worker:
    """One configuration's process, from a source tree; ``fit`` runs one fit in it and waits for the reply."""

    def __init__(self, label: str, tree: str, name: str, threads: int, log_dir: str, checksum: str = "") -> None:
        self.label = label
        env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", WHOLE_STEP_TENSORBOARD_CHECKSUM=checksum)
        log = open(os.path.join(log_dir, label.replace(" ", "_").replace(":", "").replace("/", "_") + ".log"), "w")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", name, "--threads",
                                      str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     text=True, env=env, cwd=tree)
        self.source: Optional[str] = None

    def fit(self, kind: str, steps: int, warmup: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{kind} {steps} {warmup}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(MARK):
                reply = json.loads(line[len(MARK):])
                if "source" not in reply:
                    return reply
                self.source = reply["source"]
        raise RuntimeError(f"the worker of {self.label!r} ended (see its log)")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def round_order(labels: list[str], seed: int) -> list[str]:
    """Plain training first, last and after every two others, the others in a shuffled order."""
    import random

    others = [label for label in labels if label != "plain"]
    random.Random(seed).shuffle(others)
    order = ["plain"]
    for i in range(0, len(others), 2):
        order += [*others[i:i + 2], "plain"]
    return order


def ratios(fits: list[tuple[str, dict[str, Any]]], label: str, column: str) -> list[float]:
    """Each fit of ``label``'s median step over the mean of the plain fits either side of it."""
    out = []
    for i, (name, reply) in enumerate(fits):
        if name != label:
            continue
        before = next((r for n, r in reversed(fits[:i]) if n == "plain"), None)
        after = next((r for n, r in fits[i + 1:] if n == "plain"), None)
        bases = [r[column] for r in (before, after) if r is not None]
        out.append(reply[column] / statistics.mean(bases))
    return out


def extra_per_module(fits: list[tuple[str, dict[str, Any]]], label: str, modules: int) -> list[float]:
    """Each fit of ``label``'s median CPU step minus its bracketing plain fits', in us per hooked module."""
    mine = [reply for name, reply in fits if name == label]
    return [(r["cpu"] - r["cpu"] / q) * 1e6 / modules for r, q in zip(mine, ratios(fits, label, "cpu"))]


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def report(runs: dict[str, list[list[tuple[str, dict[str, Any]]]]], labels: list[str]) -> tuple[str, dict[str, Any]]:
    """The markdown table (wall ratio with its range over rounds, CPU ratio, extra CPU per module) and the figures."""
    lines = ["| model | hooked modules | plain step, wall / CPU (ms) | one gradient read (ms) | configuration |"
             " before: x plain, wall (range) | CPU | after: x plain, wall (range) | CPU |"
             " after: extra CPU per module (us) |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    figures: dict[str, Any] = {}
    for kind, rounds in runs.items():
        plain = [r for fits in rounds for n, r in fits if n == "plain"]
        modules = plain[0]["modules"]
        wall, cpu = (statistics.median(r[c] for r in plain) * 1e3 for c in ("wall", "cpu"))
        read = statistics.median(r["read"] for r in plain) * 1e3
        head = f"| {kind} | {modules} | {wall:.2f} / {cpu:.2f} | {read:.2f} |"
        figures[kind] = {"modules": modules, "plain_wall_ms": wall, "plain_cpu_ms": cpu, "read_ms": read}
        for name in (*BASELINES, *CONFIGS):
            if not any(label == name or label.endswith(f": {name}") for label in labels):  # not run (--configs)
                continue
            cells = []
            for side in ("before", "after"):
                label = name if name in BASELINES else f"{side}: {name}"
                w = [x for fits in rounds for x in ratios(fits, label, "wall")]
                c = [x for fits in rounds for x in ratios(fits, label, "cpu")]
                if name in BASELINES and side == "before":
                    cells += ["", ""]
                    continue
                cells += [_cell(w), f"{statistics.median(c):.3f}" if c else "-"]
                figures[kind][label] = {"wall": w, "cpu": c}
            label = name if name in BASELINES else f"after: {name}"
            extra = [x for fits in rounds for x in extra_per_module(fits, label, modules)] if label in labels else []
            figures[kind].setdefault(label, {})["extra_us_per_module"] = extra
            per_module = f"{statistics.median(extra):.1f}" if extra else "-"
            lines.append(f"{head} {name} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {per_module} |")
            head = "| | | | |"
    return "\n".join(lines), figures


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=None, help="a checkout of the commit to compare with (its own tree)")
    parser.add_argument("--depths", default="10,100,400,1000")
    parser.add_argument("--no-decoder", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rounds-1000", type=int, default=2, help="rounds of the 1,000-layer stack (slow fits)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every model's timed steps by this")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", default="", help="run only the configurations whose names contain one of these"
                        " comma-separated words (e.g. 'not logged'); plain training always runs")
    parser.add_argument("--output", default=None, help="write the figures here as JSON")
    parser.add_argument("--tensorboard-checksum", action="store_true",
                        help="in the --before tree, leave TensorBoard's records to its own Python checksum"
                             " (a tree from before 738839b computed it in C by changing the writer's class)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.threads)
        return 0
    steps = {"stack10": 40, "stack100": 25, "stack400": 12, "stack1000": 8, "gpt2-style": 10}
    kinds = [f"stack{d}" for d in args.depths.split(",") if d] + ([] if args.no_decoder else ["gpt2-style"])
    after = str(HERE.parent)
    trees = {"after": after, **({"before": str(Path(args.before).resolve())} if args.before else {})}
    plan = {"plain": (after, "plain"), "plain (A/A)": (after, "plain"),
            "three empty callbacks": (after, "three empty callbacks")}
    wanted = [word for word in args.configs.split(",") if word]
    chosen = [name for name in CONFIGS if not wanted or any(word in name for word in wanted)]
    plan.update({f"{side}: {name}": (tree, name) for side, tree in sorted(trees.items()) for name in chosen})
    log_dir = tempfile.mkdtemp(prefix="whole_step_logs_")
    start = time.time()
    checksum = "1" if args.tensorboard_checksum else ""
    workers = {label: Worker(label, tree, name, args.threads, log_dir, checksum)
               for label, (tree, name) in plan.items()}
    runs: dict[str, list[list[tuple[str, dict[str, Any]]]]] = {kind: [] for kind in kinds}
    try:
        for label, w in workers.items():  # every process started and warm (imports, a first fit) before timing
            w.fit("stack10", 2, 1)
            print(f"{label}: {w.source}", file=sys.stderr, flush=True)
        for r in range(args.rounds):
            for kind in kinds:
                if kind == "stack1000" and r >= args.rounds_1000:
                    continue
                order = round_order(list(plan), r)
                n = max(4, round(steps[kind] * args.scale))
                runs[kind].append([(label, workers[label].fit(kind, n, 3)) for label in order])
            print(f"round {r + 1}/{args.rounds} timed, {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    table, figures = report(runs, list(plan))
    print(table)
    print(f"\n{time.time() - start:.0f} s in all; worker logs in {log_dir}")
    if args.output:
        Path(args.output).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
