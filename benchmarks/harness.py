"""The benchmark harness: one timed fit, the interleaved rounds, and each configuration's ratio to "none".

Device-agnostic: a ``Device`` names the Trainer's accelerator and how to wait for its queued work,
and every other benchmark piece (what is trained, which callbacks run) comes in as an argument:

- a ``Workload`` builds the model and its batches;
- a ``Config`` builds one fit's callbacks and says which of its steps are logged ones.

``overhead.py`` wires the CPU benchmark from these; ``transfers.py`` counts host transfers with the
same ``run_fit``.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

LOG_EVERY = 50  # the "most steps are not logged" interval: the Trainer's, and the /50 configurations'

Steps = list[tuple[int, float, float]]  # (global step, wall s, CPU s) per timed step of one fit
Runs = dict[tuple[str, int], list[tuple[str, Steps]]]  # (model, round) -> the round's fits, in order


def _no_sync() -> None:
    """The CPU runs each op before the next: nothing is queued to wait for."""


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Device:
    """Where the fits run: the Trainer's ``accelerator``, and ``synchronize`` to wait for its queued work.

    ``StepTimer`` calls ``synchronize`` before reading the clock, so a step's time holds the
    kernels it queued (``Device("cuda", torch.cuda.synchronize)`` on a GPU).
    """

    accelerator: str = "cpu"
    synchronize: Callable[[], None] = _no_sync


CPU = Device()


@dataclass(frozen=True)
class Workload:
    """What one fit trains: ``model()`` builds a fresh, seeded module; ``batches(n)`` its ``n`` batches."""

    model: Callable[[], pl.LightningModule]
    batches: Callable[[int], list[Any]]


@dataclass
class Config:
    """One benchmarked configuration: the callbacks of a fit, and which of its steps they log on."""

    name: str
    description: str
    callbacks: Callable[[str], list[Callback]]  # tmp dir -> fresh callbacks
    logged: Callable[[int], bool] = lambda step: False  # which global steps are "logged" steps
    every: Optional[int] = None
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    partner: Optional[str] = None  # the every-step config whose logged-step time this one borrows


@dataclass(frozen=True)
class Schedule:
    """How long the timed fits run: ``warmup`` untimed + ``steps`` timed steps, in ``rounds`` rounds.

    A fit stops being timed once it has ``min_steps`` timed steps that took over ``fit_seconds``.
    """

    steps: int
    rounds: int
    warmup: int
    min_steps: int
    fit_seconds: float


class StepTimer(Callback):
    """Start of every training batch, wall and process CPU time; a step runs to the next batch's start.

    Put first in ``callbacks``, so that a step holds every other callback's hooks. Stops the fit
    once ``min_steps`` steps from ``first`` on took more than ``budget_s`` seconds in all, so that
    slow configurations cost a round no more time than fast ones.
    """

    def __init__(self, first: int, min_steps: int, budget_s: float, synchronize: Callable[[], None] = _no_sync) -> None:
        self.first, self.min_steps, self.budget_s = first, min_steps, budget_s
        self.synchronize = synchronize
        self.starts: list[tuple[int, float, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.synchronize()
        self.starts.append((trainer.global_step, time.perf_counter(), time.process_time()))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        timed = [t for step, t, _ in self.starts if step >= self.first]
        if len(timed) >= self.min_steps and time.perf_counter() - timed[0] > self.budget_s:
            trainer.should_stop = True  # the next batch never starts: this step goes untimed

    def durations(self, first: int) -> Steps:
        """``(step, wall seconds, CPU seconds)`` of every step from ``first`` on but the last."""
        pairs = zip(self.starts, self.starts[1:])
        return [(step, w1 - w0, c1 - c0) for (step, w0, c0), (_, w1, c1) in pairs if step >= first]


def run_fit(workload: Workload, config: Config, n_steps: int, tmp: str, version: str, device: Device = CPU,
            extra: Optional[list[Callback]] = None) -> None:
    """``Trainer.fit`` for ``n_steps`` optimizer steps of ``config`` on ``device``, TensorBoard logger."""
    model = workload.model()
    trainer = pl.Trainer(
        accelerator=device.accelerator, devices=1, max_steps=n_steps, max_epochs=-1,
        logger=TensorBoardLogger(save_dir=tmp, name=config.name.replace("/", "_"), version=version),
        callbacks=[*(extra or []), *config.callbacks(tmp)],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        log_every_n_steps=LOG_EVERY, limit_val_batches=0, num_sanity_val_steps=0,
        **config.trainer_kwargs,
    )
    batches: Any = workload.batches(n_steps)
    loader: DataLoader = DataLoader(batches, batch_size=None)  # the prebuilt batches, as they are
    trainer.fit(model, train_dataloaders=loader)


def round_order(names: list[str], seed: int, every: int = 2) -> list[str]:
    """The configurations in a shuffled order, with "none" first, last and after every ``every`` others.

    Each configuration is then timed right beside a baseline fit, and its ratio is taken against
    the baseline fits on either side: the machine's load drifts over seconds, not within them.
    """
    others = [n for n in names if n != "none"]
    random.Random(seed).shuffle(others)
    order = ["none"]
    for i in range(0, len(others), every):
        order += [*others[i : i + every], "none"]
    return order


def timed_rounds(configs: Mapping[str, Config], workloads: Mapping[str, Workload], schedule: Schedule, tmp: str,
                 device: Device = CPU, progress: Callable[[str], None] = _to_stderr) -> Runs:
    """Every configuration and workload once per round (and "none" between them), timed step by step."""
    s = schedule
    for kind, workload in workloads.items():  # first-fit costs (lazy imports, allocator growth): an untimed fit
        run_fit(workload, configs["none"], s.warmup + 2, tmp, f"{kind}-warmup", device)
    runs: Runs = {(kind, r): [] for kind in workloads for r in range(s.rounds)}
    for r in range(s.rounds):
        for name in round_order(list(configs), r):
            for kind, workload in workloads.items():
                timer = StepTimer(s.warmup, s.min_steps + 1, s.fit_seconds, device.synchronize)
                run_fit(workload, configs[name], s.warmup + s.steps + 1, tmp, f"{kind}-r{r}", device, [timer])
                runs[(kind, r)].append((name, timer.durations(s.warmup)))
        progress(f"round {r + 1}/{s.rounds} timed")
    return runs


# --------------------------------------------------------------------------------------------
# Ratios to "none"
# --------------------------------------------------------------------------------------------


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _bracketing_base(fits: list[tuple[str, Steps]], i: int, column: int) -> Optional[float]:
    """The mean of the medians of the nearest "none" fits before and after fit ``i``."""
    before = next((f for f in reversed(fits[:i]) if f[0] == "none"), None)
    after = next((f for f in fits[i + 1 :] if f[0] == "none"), None)
    medians = [statistics.median(s[column] for s in f[1]) for f in (before, after) if f and f[1]]
    return statistics.mean(medians) if medians else None


def _ratios(runs: Runs, kind: str, name: str, column: int, keep: Callable[[int], bool]) -> list[float]:
    """Per fit of ``name``: median of its kept steps over its bracketing baseline."""
    out = []
    for (model, _), fits in runs.items():
        for i, (fit_name, steps) in enumerate(fits):
            kept = [s[column] for s in steps if keep(s[0])]
            if model == kind and fit_name == name and kept:
                base = _bracketing_base(fits, i, column) if name != "none" else statistics.median(kept)
                if base:
                    out.append(statistics.median(kept) / base)
    return out


def _negate(predicate: Callable[[int], bool]) -> Callable[[int], bool]:
    return lambda step: not predicate(step)


def analyse(runs: Runs, configs: Mapping[str, Config], models: list[str]) -> dict[str, Any]:
    """Per model and config: pooled medians (ms) and the median over fits of the ratio to "none"."""
    out: dict[str, Any] = {}
    for kind in models:
        out[kind] = {}
        for name, cfg in configs.items():
            steps = [s for (model, _), fits in runs.items() if model == kind for n, f in fits if n == name for s in f]
            wall = _ratios(runs, kind, name, 1, lambda step: True)
            logged = _ratios(runs, kind, name, 1, cfg.logged)
            quiet = _ratios(runs, kind, name, 1, _negate(cfg.logged))
            out[kind][name] = {
                "ms": _median([w * 1e3 for _, w, _ in steps]),
                "ms_logged": _median([w * 1e3 for step, w, _ in steps if cfg.logged(step)]),
                "ms_non_logged": _median([w * 1e3 for step, w, _ in steps if not cfg.logged(step)]),
                "ratio": _median(wall), "ratio_min": min(wall), "ratio_max": max(wall),
                "ratio_cpu": _median(_ratios(runs, kind, name, 2, lambda step: True)),
                "ratio_logged": _median(logged), "ratio_non_logged": _median(quiet),
                "ratio_non_logged_cpu": _median(_ratios(runs, kind, name, 2, _negate(cfg.logged))),
                "n_steps": len(steps), "n_fits": len(wall),
            }
        for name, cfg in configs.items():
            _amortise(out[kind], name, cfg)
    return out


def _amortise(rows: dict[str, Any], name: str, cfg: Config) -> None:
    """Cost of logging every N steps: N - 1 non-logged steps and one logged step, as a ratio to "none"."""
    row = rows[name]
    if not cfg.every or cfg.every == 1 or row["ratio_non_logged"] is None:
        return
    logged, borrowed = row["ratio_logged"], False
    if logged is None and cfg.partner in rows:  # no logged step timed: take the every-step config's
        logged, borrowed = rows[cfg.partner]["ratio"], True
    if logged is not None:
        row["ratio_amortised"] = (row["ratio_non_logged"] * (cfg.every - 1) + logged) / cfg.every
        row["amortised_borrowed"] = borrowed
