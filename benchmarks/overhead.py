"""Overhead of lightning_hooks callbacks on CPU training steps, beside the tools people use instead.

Runs real ``Trainer.fit`` calls, one per configuration and model, over several rounds, on the
models of ``configs.py`` (``mlp``: 4 Linear layers of width 1024, batch 256; ``cnn``: 3 conv
layers on synthetic 3x32x32 images, batch 64; ``gpt2``: a GPT-2-style decoder built from its
sizes, 12 blocks of width 64, 87 hooked modules).

A step's wall (and CPU) time runs from one ``on_train_batch_start`` to the next, so it holds every
callback hook, the optimizer step and the logger writes. Each round runs the configurations in a
new shuffled order with a baseline fit ("none", no callbacks) first, last and after every two of
them; each fit's median step time is divided by the mean of its two neighbouring baselines' and
the median of those ratios over rounds is reported. A second no-callback configuration (A/A)
shows the noise floor.

Then, per configuration: host transfers per logged and per non-logged step (counted by a
``TorchFunctionMode`` that charges each device-to-host call to the callback that made it), and
the peak memory of a fresh subprocess that runs the same fits.

Usage::

    python benchmarks/overhead.py            # full run, 4-5 minutes on 2 cores before the decoder came
    python benchmarks/overhead.py --quick    # smoke run, under a minute, prints only
    python benchmarks/overhead.py --steps 30 --rounds 6 --models mlp --configs monitors/50

Writes ``benchmarks/results.md`` (Markdown tables) and ``benchmarks/results.json``; see
``benchmarks/README.md`` for what each row and column means.

This script holds the command line and the order of the passes; the parts live beside it:
``harness.py`` (one timed fit, the interleaved rounds, the ratios), ``transfers.py`` (the host-transfer
counter), ``configs.py`` (the models and configurations), ``peers.py`` (the naive monitor and
``wandb.watch``) and ``report.py`` (targets and tables).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import torch
from configs import MODELS, WORKLOADS, build_configs
from harness import Config, Schedule, analyse, run_fit, timed_rounds
from peers import TRANSFER_OWNERS, finish_wandb
from report import check_targets, machine, render
from transfers import count_transfers

HERE = Path(__file__).resolve().parent
ARG_NAMES = ("steps", "rounds", "min_steps", "fit_seconds", "warmup", "threads", "count_steps", "memory_steps",
             "quick")
OWNERS = {"lightning_hooks": None, **TRANSFER_OWNERS}  # whose host transfers are counted, charged to whom


# --------------------------------------------------------------------------------------------
# Peak memory, in a fresh subprocess per configuration
# --------------------------------------------------------------------------------------------


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory_child(config_name: str, models: list[str], n_steps: int) -> dict[str, Any]:
    """Run in the subprocess: peak RSS and Python-heap peak of one configuration's fits."""
    notes: list[str] = []
    config = build_configs(notes)[config_name]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["WANDB_DIR"] = tmp
        for kind in models:
            gc.collect()
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
            before = _status_mib("VmRSS")
            run_fit(WORKLOADS[kind], config, n_steps, tmp, f"{kind}-mem")
            peak = _status_mib("VmHWM")
            if peak != peak:  # no /proc: fall back to the process-wide peak
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            tracemalloc.start()
            run_fit(WORKLOADS[kind], config, n_steps, tmp, f"{kind}-trace")
            _, py_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            out[kind] = {"rss_peak_mib": peak, "rss_growth_mib": peak - before, "py_peak_mib": py_peak / 2**20}
        finish_wandb()
    return out


def measure_memory(config_name: str, models: list[str], n_steps: int, threads: int) -> dict[str, Any]:
    """Peak memory of ``config_name``'s fits, measured in a fresh interpreter."""
    cmd = [sys.executable, __file__, "--_memory-child", config_name, "--models", ",".join(models),
           "--memory-steps", str(n_steps), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "wandb"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _progress(args: argparse.Namespace, message: str) -> None:
    print(f"[{time.perf_counter() - args.t0:5.0f} s] {message}", file=sys.stderr, flush=True)


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (~1 min): 2 rounds x 4 steps, no memory")
    parser.add_argument("--steps", type=int, help="timed steps per fit (default 20; quick 4)")
    parser.add_argument("--rounds", type=int, help="round-robin rounds (default 4; quick 2)")
    parser.add_argument("--fit-seconds", type=float, help="cut a fit's timing after this (default 1.5; quick 0.3)")
    parser.add_argument("--min-steps", type=int, default=3, help="timed steps a fit always gets")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each fit")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: steadier on a shared machine; 0: torch's default)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of mlp,cnn,gpt2")
    parser.add_argument("--configs", help="comma-separated subset of the configurations ('none' always runs)")
    parser.add_argument("--count-steps", type=int, help="steps of each host-transfer count (default 4)")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps of each memory fit")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-config memory subprocesses")
    parser.add_argument("--output", help="path stem of the .md and .json (default benchmarks/results; --quick"
                        " writes no file unless given)")
    parser.add_argument("--_memory-child", dest="memory_child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 20)
    args.rounds = args.rounds or (2 if args.quick else 4)
    args.fit_seconds = args.fit_seconds or (0.3 if args.quick else 1.5)
    args.min_steps = min(args.min_steps, args.steps)
    args.count_steps = args.count_steps or (2 if args.quick else 4)
    args.no_memory = args.no_memory or args.quick
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if bad := [m for m in args.models if m not in MODELS]:
        parser.error(f"unknown model(s) {bad}; choose from {MODELS}")
    if min(args.steps, args.rounds, args.count_steps, args.min_steps) < 1 or args.threads < 0:
        parser.error("--steps, --rounds, --count-steps and --min-steps must be >= 1, --threads >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.t0 = time.perf_counter()
    return args


def _select(args: argparse.Namespace, notes: list[str]) -> dict[str, Config]:
    """The configurations ``--configs`` asks for ('none' and its A/A twin always run)."""
    configs = build_configs(notes)
    if args.configs:
        wanted = {"none", "none (A/A)", *(c.strip() for c in args.configs.split(","))}
        if unknown := wanted - set(configs):
            sys.exit(f"unknown config(s) {sorted(unknown)}; available: {list(configs)}")
        configs = {n: c for n, c in configs.items() if n in wanted}
    for note in notes:
        _progress(args, f"note: {note}")
    _progress(args, f"configs: {', '.join(configs)}; models: {', '.join(args.models)}")
    return configs


def _measure(configs: dict[str, Config], args: argparse.Namespace) -> dict[str, Any]:
    """The three passes: timed rounds, host-transfer counts, and (unless ``--no-memory``) peak memory."""
    workloads = {kind: WORKLOADS[kind] for kind in args.models}
    schedule = Schedule(args.steps, args.rounds, args.warmup, args.min_steps, args.fit_seconds)
    with tempfile.TemporaryDirectory(prefix="lh-bench-") as tmp:
        os.environ["WANDB_DIR"] = tmp
        runs = timed_rounds(configs, workloads, schedule, tmp, progress=lambda m: _progress(args, m))
        transfers: dict[str, dict[str, Any]] = defaultdict(dict)
        for name, cfg in configs.items():
            for kind, workload in workloads.items():
                if name != "none (A/A)":
                    transfers[kind][name] = count_transfers(workload, cfg, args.count_steps, tmp,
                                                            f"{kind}-count", OWNERS)
        _progress(args, "host transfers counted")
        finish_wandb()
    memory: dict[str, Any] = {}
    if not args.no_memory:
        for name in configs:
            if name != "none (A/A)":
                memory[name] = measure_memory(name, args.models, args.memory_steps, args.threads)
        _progress(args, "memory measured")
    return {"runs": runs, "transfers": transfers, "memory": memory}


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    _quiet()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.models, args.memory_steps)))
        return 0
    notes: list[str] = []
    configs = _select(args, notes)
    measured = _measure(configs, args)
    runs, transfers = measured["runs"], measured["transfers"]
    timing = analyse(runs, configs, args.models)
    results = {
        "machine": machine(), "models": args.models, "notes": notes,
        "args": {k: getattr(args, k) for k in ARG_NAMES},
        "configs": {n: {"description": c.description, "every": c.every} for n, c in configs.items()},
        "timing": timing, "transfers": transfers, "memory": measured["memory"],
        "targets": check_targets(timing, transfers, args.models),
        "runs": {f"{kind}|round{r}": fits for (kind, r), fits in runs.items()},
        "wall_s": time.perf_counter() - args.t0,
    }
    output = args.output or (None if args.quick else str(HERE / "results"))
    if output:
        Path(output + ".json").write_text(json.dumps(results, indent=1))
        Path(output + ".md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
