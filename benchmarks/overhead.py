"""Overhead of lightning_hooks callbacks on CPU training steps, beside the tools people use instead.

Runs real ``Trainer.fit`` calls, one per configuration and model, over several rounds, on:

- ``mlp``: 4 Linear layers of width 1024 with ReLU, batch 256;
- ``cnn``: 3 conv layers on synthetic 3x32x32 images, batch 64.

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

    python benchmarks/overhead.py            # full run, 4-5 minutes on 2 cores
    python benchmarks/overhead.py --quick    # smoke run, under a minute, prints only
    python benchmarks/overhead.py --steps 30 --rounds 6 --models mlp --configs monitors/50

Writes ``benchmarks/results.md`` (Markdown tables) and ``benchmarks/results.json``; see
``benchmarks/README.md`` for what each row and column means.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import importlib.util
import inspect
import json
import logging
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import lightning
import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader

from lightning_hooks import ActivationMonitor
from lightning_hooks.selection import select_modules

HERE = Path(__file__).resolve().parent
LOG_EVERY = 50  # the "most steps are not logged" interval
MODELS = ("mlp", "cnn")
ARG_NAMES = ("steps", "rounds", "min_steps", "fit_seconds", "warmup", "threads", "count_steps", "memory_steps",
             "quick")


# --------------------------------------------------------------------------------------------
# Models and data
# --------------------------------------------------------------------------------------------


class BenchModule(pl.LightningModule):
    """A plain classifier: ``self(x)`` (so module and whole-model hooks fire), cross-entropy, SGD."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


def make_model(kind: str) -> BenchModule:
    torch.manual_seed(0)
    if kind == "mlp":
        layers: list[nn.Module] = []
        for _ in range(3):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        return BenchModule(nn.Sequential(*layers, nn.Linear(1024, 1024)))
    if kind == "cnn":
        return BenchModule(nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(32, 10),
        ))
    raise ValueError(f"unknown model {kind!r}; choose from {MODELS}")


def make_batches(kind: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches in memory (4 distinct ones, repeated), so data loading costs every config alike."""
    gen = torch.Generator().manual_seed(1)
    if kind == "mlp":
        distinct = [(torch.randn(256, 1024, generator=gen), torch.randint(0, 1024, (256,), generator=gen))
                    for _ in range(4)]
    else:
        distinct = [(torch.randn(64, 3, 32, 32, generator=gen), torch.randint(0, 10, (64,), generator=gen))
                    for _ in range(4)]
    return [distinct[i % 4] for i in range(n)]


# --------------------------------------------------------------------------------------------
# Reference callbacks: the naive monitor, wandb.watch
# --------------------------------------------------------------------------------------------


class NaiveHistogramMonitor(Callback):
    """The pattern of older monitors (e.g. Lightning Bolts' ``ModuleDataMonitor``).

    A forward hook on each module (the same modules ActivationMonitor picks by default) copies the
    output to the host with ``.cpu()``, histograms it with numpy and writes it to TensorBoard, on
    every logged step: one device-to-host copy per module per step, and the statistics on the CPU.
    """

    def __init__(self, log_every_n_steps: int = 1, bins: int = 64) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.bins = bins
        self._handles: list[Any] = []
        self._active = False
        self._step = 0
        self._writer: Any = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._writer = getattr(trainer.logger, "experiment", None)
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in select_modules(pl_module, None)]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if not self._active or self._writer is None:
                return
            values = output.detach().cpu().numpy()
            counts, edges = np.histogram(values, bins=self.bins)
            self._writer.add_histogram_raw(
                f"naive/{name}", min=float(values.min()), max=float(values.max()), num=int(values.size),
                sum=float(values.sum()), sum_squares=float(np.square(values, dtype=np.float64).sum()),
                bucket_limits=edges[1:].tolist(), bucket_counts=counts.tolist(), global_step=self._step,
            )
            self._writer.add_scalar(f"naive/{name}/std", float(values.std()), self._step)
        return hook

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step = trainer.global_step
        self._active = self._step % self.log_every_n_steps == 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._active = False

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


_WANDB_RUN: Any = None


def _wandb_run(tmp: str) -> Any:
    """One offline wandb run for the whole benchmark (started lazily, finished at exit)."""
    global _WANDB_RUN
    if _WANDB_RUN is None:
        import wandb

        try:  # no system-metrics sampling: it would load the machine under every config alike
            settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True,
                                      x_disable_machine_info=True)
        except Exception:  # older wandb: other names for those settings
            settings = wandb.Settings(console="off", silent=True)
        _WANDB_RUN = wandb.init(project="lightning-hooks-bench", mode="offline", dir=tmp, settings=settings)
    return _WANDB_RUN


def _finish_wandb() -> None:
    global _WANDB_RUN
    if _WANDB_RUN is not None:
        _WANDB_RUN.finish()
        _WANDB_RUN = None


class WandbWatch(Callback):
    """``wandb.watch(model, log="all", log_freq=...)`` for one fit, committing what it logs.

    watch's hooks log histograms of every parameter and gradient with ``commit=False`` on every
    ``log_freq``-th forward/backward; the commit here stands in for the ``wandb.log`` that a
    logger would make on that step.
    """

    def __init__(self, log_freq: int, tmp: str) -> None:
        self.log_freq = log_freq
        self.tmp = tmp

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import wandb

        _wandb_run(self.tmp)
        wandb.watch(pl_module, log="all", log_freq=self.log_freq)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step % self.log_freq == 0:
            _wandb_run(self.tmp).log({"trainer/global_step": trainer.global_step})

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if _WANDB_RUN is not None:
            import wandb

            wandb.unwatch(pl_module)


# --------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------


@dataclass
class Config:
    name: str
    description: str
    callbacks: Callable[[str], list[Callback]]  # tmp dir -> fresh callbacks
    logged: Callable[[int], bool] = lambda step: False  # which global steps are "logged" steps
    every: Optional[int] = None
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    partner: Optional[str] = None  # the every-step config whose logged-step time this one borrows


def _optional(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _accepts(cls: Any, argument: str) -> bool:
    return cls is not None and argument in inspect.signature(cls).parameters


def _every(n: int) -> Callable[[int], bool]:
    return lambda step: step % n == 0


def _wandb_every(n: int) -> Callable[[int], bool]:
    return lambda step: (step + 1) % n == 0  # watch counts calls from 1 and logs on the n-th


def build_configs(notes: list[str]) -> dict[str, Config]:
    """Every configuration this environment can run; what is missing goes to ``notes``."""
    grad_cls = _optional("lightning_hooks.gradients", "GradientMonitor")
    stop_cls = _optional("lightning_hooks.stopping", "GradientAnomalyStopping")
    if grad_cls is None:
        notes.append("GradientMonitor is not importable yet: the monitor rows hold ActivationMonitor only.")

    def monitors(every: int, **grad_kwargs: Any) -> Callable[[str], list[Callback]]:
        def make(tmp: str) -> list[Callback]:
            cbs: list[Callback] = [ActivationMonitor(log_every_n_steps=every)]
            if grad_cls is not None:
                cbs.append(grad_cls(log_every_n_steps=every, **grad_kwargs))
            return cbs
        return make

    names = "ActivationMonitor" + (" + GradientMonitor" if grad_cls is not None else "")
    configs = [
        Config("none", "no callbacks (baseline)", lambda tmp: []),
        Config("none (A/A)", "no callbacks again: the noise floor", lambda tmp: []),
        Config(f"monitors/{LOG_EVERY}", f"{names}, log_every_n_steps={LOG_EVERY}", monitors(LOG_EVERY),
               _every(LOG_EVERY), LOG_EVERY, partner="monitors/1"),
        Config("monitors/1", f"{names}, log_every_n_steps=1", monitors(1), _every(1), 1),
    ]
    if _accepts(grad_cls, "check_finite"):
        configs.append(Config(
            f"monitors/{LOG_EVERY} unchecked",
            f"as monitors/{LOG_EVERY}, with GradientMonitor(check_finite=False): no per-step gradient check",
            monitors(LOG_EVERY, check_finite=False), _every(LOG_EVERY), LOG_EVERY,
        ))
    configs += [
        Config("activations/1", "ActivationMonitor(log_every_n_steps=1) alone",
               lambda tmp: [ActivationMonitor(log_every_n_steps=1)], _every(1), 1),
    ]
    if grad_cls is not None:
        configs.append(Config("gradients/1", "GradientMonitor(log_every_n_steps=1) alone",
                              lambda tmp: [grad_cls(log_every_n_steps=1)], _every(1), 1))
    if _accepts(grad_cls, "provenance"):
        configs.append(Config(
            "provenance", f"GradientMonitor(log_every_n_steps={LOG_EVERY}, provenance=True)",
            lambda tmp: [grad_cls(log_every_n_steps=LOG_EVERY, provenance=True)], _every(LOG_EVERY), LOG_EVERY,
        ))
    if _accepts(stop_cls, "provenance"):
        configs.append(Config(
            "stopping+provenance", "GradientAnomalyStopping(provenance=True): checks every step",
            lambda tmp: [stop_cls(provenance=True)], _every(1),
        ))
    if not _accepts(grad_cls, "provenance") and not _accepts(stop_cls, "provenance"):
        notes.append("Neither GradientMonitor nor GradientAnomalyStopping takes `provenance` yet: no provenance row.")
    configs += [
        Config("naive/1", "naive reference: per-module .cpu() + numpy histogram in forward hooks, every step",
               lambda tmp: [NaiveHistogramMonitor(1)], _every(1), 1),
        Config("detect_anomaly", "Trainer(detect_anomaly=True), i.e. torch.autograd.detect_anomaly",
               lambda tmp: [], trainer_kwargs={"detect_anomaly": True}),
    ]
    if importlib.util.find_spec("wandb") is not None:
        configs += [
            Config("wandb.watch/1", 'wandb.watch(model, log="all", log_freq=1), offline',
                   lambda tmp: [WandbWatch(1, tmp)], _wandb_every(1), 1),
            Config(f"wandb.watch/{LOG_EVERY}", f'wandb.watch(model, log="all", log_freq={LOG_EVERY}), offline',
                   lambda tmp: [WandbWatch(LOG_EVERY, tmp)], _wandb_every(LOG_EVERY), LOG_EVERY,
                   partner="wandb.watch/1"),
        ]
    else:
        notes.append("wandb is not installed (pip install -e .[bench]): the wandb.watch rows are skipped.")
    return {c.name: c for c in configs}


# --------------------------------------------------------------------------------------------
# One fit
# --------------------------------------------------------------------------------------------


class StepTimer(Callback):
    """Start of every training batch, wall and process CPU time; a step runs to the next batch's start.

    Put first in ``callbacks``, so that a step holds every other callback's hooks. Stops the fit
    once ``min_steps`` steps from ``first`` on took more than ``budget_s`` seconds in all, so that
    slow configurations cost a round no more time than fast ones.
    """

    def __init__(self, first: int, min_steps: int, budget_s: float) -> None:
        self.first, self.min_steps, self.budget_s = first, min_steps, budget_s
        self.starts: list[tuple[int, float, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.starts.append((trainer.global_step, time.perf_counter(), time.process_time()))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        timed = [t for step, t, _ in self.starts if step >= self.first]
        if len(timed) >= self.min_steps and time.perf_counter() - timed[0] > self.budget_s:
            trainer.should_stop = True  # the next batch never starts: this step goes untimed

    def durations(self, first: int) -> list[tuple[int, float, float]]:
        """``(step, wall seconds, CPU seconds)`` of every step from ``first`` on but the last."""
        pairs = zip(self.starts, self.starts[1:])
        return [(step, w1 - w0, c1 - c0) for (step, w0, c0), (_, w1, c1) in pairs if step >= first]


class StepMarker(Callback):
    """Tells the host-transfer counter which step is running."""

    def __init__(self, counter: TransferCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.counter.step = trainer.global_step


def run_fit(model_kind: str, config: Config, n_steps: int, tmp: str, version: str,
            extra: Optional[list[Callback]] = None) -> None:
    """``Trainer.fit`` for ``n_steps`` optimizer steps of ``config``, on CPU, TensorBoard logger."""
    model = make_model(model_kind)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=n_steps, max_epochs=-1,
        logger=TensorBoardLogger(save_dir=tmp, name=config.name.replace("/", "_"), version=version),
        callbacks=[*(extra or []), *config.callbacks(tmp)],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        log_every_n_steps=LOG_EVERY, limit_val_batches=0, num_sanity_val_steps=0,
        **config.trainer_kwargs,
    )
    batches: Any = make_batches(model_kind, n_steps)
    loader: DataLoader = DataLoader(batches, batch_size=None)  # the prebuilt batches, as they are
    trainer.fit(model, train_dataloaders=loader)


# --------------------------------------------------------------------------------------------
# Host transfers
# --------------------------------------------------------------------------------------------

_T = torch.Tensor
_READS = {_T.item, _T.tolist, _T.numpy, _T.__bool__, _T.__float__, _T.__int__, _T.__index__,
          _T.__array__, _T.__format__, _T.__repr__}
_TO_HOST = {_T.cpu}
_DATA_DEPENDENT = {torch.nonzero, _T.nonzero, torch.masked_select, _T.masked_select, torch.unique,
                   _T.unique, torch.argwhere, _T.argwhere, torch.repeat_interleave}


class TransferCounter(TorchFunctionMode):
    """Counts device-to-host transfers, per step and per callback that caused them.

    On a CPU-only machine every tensor is on the host, so "would be a sync on an accelerator" is
    tracked by hand: tensors are device-resident unless proven host-resident (made by a factory
    without ``device=``, computed only from host tensors, or the result of ``.cpu()`` /
    ``.to("cpu")``). A transfer is ``.item()``, ``.tolist()``, ``.numpy()``, ``bool()``,
    ``float()``, ``int()``, ``.cpu()``, ``.to("cpu")``, a boolean-mask index or a data-dependent
    shape op (``nonzero``, ``masked_select``, ``unique``) on a device-resident tensor. Calls are
    attributed to the innermost lightning_hooks, naive-reference or wandb frame on the stack (and
    to the callback object found above it); Lightning's own transfers are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.step = -1
        self.counts: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.sites: dict[str, int] = defaultdict(int)
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark_host(self, value: Any) -> None:
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor) and not self._is_host(t):
                self._host[id(t)] = weakref.ref(t, functools.partial(self._forget, id(t)))

    def _forget(self, key: int, _: Any) -> None:
        self._host.pop(key, None)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device_in = [t for t in tensors if not self._is_host(t)]
        to_host, to_device, kind = False, False, None
        if func in _READS and device_in:
            kind = "read"
        elif func in _TO_HOST:
            to_host, kind = True, ("copy" if device_in else None)
        elif func is _T.to:
            targets = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, (str, torch.device))]
            to_host = any(isinstance(a, str) and a.startswith("cpu") for a in targets)
            to_device = bool(targets) and not to_host  # `.to(some_tensor.device)`: the accelerator, on a GPU
            kind = "copy" if to_host and device_in else None
        elif func in _DATA_DEPENDENT and device_in:
            kind = "shape"
        elif func is _T.__getitem__ and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                             for i in tree_flatten(args[1:])[0]) and device_in:
            kind = "shape"
        if kind is not None:
            self._record(kind)
        out = func(*args, **kwargs)
        if (to_device and self._is_host(out) or to_host and not self._is_host(out)) and out is args[0]:
            out = out.clone()  # on CPU `.to(cpu)`, `.cpu()` return self; on an accelerator they copy
        if to_host or not to_device and (tensors and not device_in or not tensors and kwargs.get("device") is None):
            self._mark_host(out)
        return out

    def _record(self, kind: str) -> None:
        frame: Any = sys._getframe(2)
        owner, site = None, None
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            code = frame.f_code
            if name.startswith(("lightning_hooks", "wandb")) or (
                code.co_filename == __file__ and code.co_name in ("hook", "_hook")
            ):
                site = f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"
                owner = "wandb.watch" if name.startswith("wandb") else self._owner(frame)
                break
            frame = frame.f_back
        if owner is not None:
            self.counts[self.step][owner] += 1
            self.sites[f"{owner} | {kind} | {site}"] += 1

    @staticmethod
    def _owner(frame: Any) -> str:
        while frame is not None:
            this = frame.f_locals.get("self")
            if isinstance(this, Callback):
                return type(this).__name__
            frame = frame.f_back
        return "lightning_hooks"


_BACKWARD_HOOK_REGISTRARS = [
    (torch.Tensor, "register_hook"), (torch.Tensor, "register_post_accumulate_grad_hook"),
    (nn.Module, "register_full_backward_hook"), (nn.Module, "register_full_backward_pre_hook"),
]


@contextlib.contextmanager
def _modes_in_backward_hooks(mode: TorchFunctionMode) -> Iterator[None]:
    """Autograd runs backward hooks without the caller's function modes: re-enter ``mode`` there."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in _BACKWARD_HOOK_REGISTRARS]

    def patched(register: Callable[..., Any]) -> Callable[..., Any]:
        def register_wrapped(self: Any, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if getattr(hook, "_in_mode", False):  # Tensor.register_hook re-dispatches through the mode
                return register(self, hook, *args, **kwargs)

            def run(*hook_args: Any, **hook_kwargs: Any) -> Any:
                with mode:
                    return hook(*hook_args, **hook_kwargs)
            run._in_mode = True  # type: ignore[attr-defined]
            return register(self, run, *args, **kwargs)
        return register_wrapped

    for owner, name, original in originals:
        setattr(owner, name, patched(original))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def count_transfers(model_kind: str, config: Config, n_steps: int, tmp: str) -> dict[str, Any]:
    """Host transfers per logged / non-logged step, per callback, over ``n_steps`` steps."""
    counter = TransferCounter()
    with _modes_in_backward_hooks(counter), counter:
        run_fit(model_kind, config, n_steps, tmp, f"{model_kind}-count", extra=[StepMarker(counter)])
    owners = sorted({o for per_step in counter.counts.values() for o in per_step})
    result: dict[str, Any] = {"per_callback": {}, "sites": dict(counter.sites)}
    for owner in owners:
        logged = [counter.counts[s].get(owner, 0) for s in range(n_steps) if config.logged(s)]
        quiet = [counter.counts[s].get(owner, 0) for s in range(n_steps) if not config.logged(s)]
        result["per_callback"][owner] = {
            "logged": statistics.mean(logged) if logged else None,
            "non_logged": statistics.mean(quiet) if quiet else None,
        }
    return result


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
            run_fit(kind, config, n_steps, tmp, f"{kind}-mem")
            peak = _status_mib("VmHWM")
            if peak != peak:  # no /proc: fall back to the process-wide peak
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            tracemalloc.start()
            run_fit(kind, config, n_steps, tmp, f"{kind}-trace")
            _, py_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            out[kind] = {"rss_peak_mib": peak, "rss_growth_mib": peak - before, "py_peak_mib": py_peak / 2**20}
        _finish_wandb()
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
# Analysis and report
# --------------------------------------------------------------------------------------------

Steps = list[tuple[int, float, float]]  # (global step, wall s, CPU s) per timed step of one fit
Runs = dict[tuple[str, int], list[tuple[str, Steps]]]  # (model, round) -> the round's fits, in order


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


def analyse(runs: Runs, configs: dict[str, Config], models: list[str]) -> dict[str, Any]:
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


def _ratio_target(label: str, row: dict[str, Any], key: str, limit: float, noise: str) -> list[Any]:
    """A "ratio <= limit" target on wall time, saying when CPU time would give the other verdict."""
    wall, cpu = row[key], row[key + "_cpu"]
    other = "" if (wall <= limit) == (cpu <= limit) else f"; CPU time says {'PASS' if cpu <= limit else 'FAIL'}"
    return [wall <= limit, f"{label} {wall:.3f}x none <= {limit}x (CPU time {cpu:.3f}x{noise}{other})"]


def check_targets(timing: dict[str, Any], transfers: dict[str, Any], models: list[str]) -> list[list[Any]]:
    """The issue's targets, per model: ``[passed, line]``; ``passed`` None for information only."""
    lines: list[list[Any]] = []
    for kind in models:
        t, noise = timing[kind], timing[kind].get("none (A/A)", {}).get("ratio")
        aa = f"; A/A {noise:.3f}x" if noise else ""
        if (row := t.get(f"monitors/{LOG_EVERY}")) and row["ratio_non_logged"] is not None:
            label = f"{kind}: non-logged steps (monitors/{LOG_EVERY})"
            lines.append(_ratio_target(label, row, "ratio_non_logged", 1.03, aa))
        if (row := t.get(f"monitors/{LOG_EVERY} unchecked")) and row["ratio_non_logged"] is not None:
            lines.append([None, f"{kind}: non-logged steps without the per-step gradient check"
                                f" (monitors/{LOG_EVERY} unchecked) {row['ratio_non_logged']:.3f}x none"])
        if row := t.get("monitors/1"):
            lines.append(_ratio_target(f"{kind}: logging every step (monitors/1)", row, "ratio", 1.5, aa))
        for name in ("provenance", "stopping+provenance"):
            if row := t.get(name):
                lines.append(_ratio_target(f"{kind}: NaN provenance ({name})", row, "ratio", 1.1, aa))
        if (theirs := t.get("wandb.watch/1", {}).get("ratio")) is not None:
            if (ours := t.get("monitors/1", {}).get("ratio")) is not None:
                third = (theirs - 1) / 3
                lines.append([ours - 1 <= third, f"{kind}: overhead logging every step (monitors/1)"
                              f" {ours - 1:+.3f} <= 1/3 of wandb.watch/1's {theirs - 1:+.3f} (= {third:+.3f})"])
            if (grads := t.get("gradients/1", {}).get("ratio")) is not None:
                lines.append([None, f"{kind}: gradients only, every step: gradients/1 {grads - 1:+.3f} vs"
                                    f" wandb.watch/1 (parameters and gradients) {theirs - 1:+.3f}"])
        w50, m50 = t.get(f"wandb.watch/{LOG_EVERY}", {}), t.get(f"monitors/{LOG_EVERY}", {})
        if "ratio_amortised" in w50 and "ratio_amortised" in m50:
            lines.append([None, f"{kind}: amortised overhead every {LOG_EVERY} steps"
                                f" {m50['ratio_amortised'] - 1:+.3f} vs wandb.watch/{LOG_EVERY}'s"
                                f" {w50['ratio_amortised'] - 1:+.3f} (estimates)"])
        lines += _transfer_targets(kind, transfers)
    return lines


def _transfer_targets(kind: str, transfers: dict[str, Any]) -> list[list[Any]]:
    lines: list[list[Any]] = []
    for name in (f"monitors/{LOG_EVERY}", "monitors/1", "activations/1", "gradients/1", "provenance",
                 "stopping+provenance"):
        for owner, v in transfers.get(kind, {}).get(name, {}).get("per_callback", {}).items():
            if v["logged"] is not None:
                lines.append([v["logged"] <= 1, f"{kind}: {owner} in {name}: {v['logged']:g} host"
                                                " transfer(s) per logged step <= 1"])
            if v["non_logged"]:
                lines.append([None, f"{kind}: {owner} in {name}: {v['non_logged']:g} host transfer(s)"
                                    " per non-logged step"])
    return lines


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
        "wandb": _optional("wandb", "__version__"), "platform": platform.platform(),
    }


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _transfers(counts: Optional[dict[str, Any]], key: str) -> str:
    if not counts:
        return "–"
    parts = [f"{_fmt(v[key], 'g')} ({owner})" for owner, v in counts["per_callback"].items() if v[key]]
    return ", ".join(parts) if parts else "0"


def _table(results: dict[str, Any], kind: str) -> list[str]:
    lines = [
        "| config | ms/step | × none | range over fits | × none, CPU time | non-logged × none"
        " | amortised × none | host transfers / logged step | / non-logged step | peak RSS MiB (Δ none)"
        " | Python heap peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    base_mem = results["memory"].get("none", {}).get(kind) or {}
    for name, row in results["timing"][kind].items():
        every = results["configs"][name]["every"]
        counts = results["transfers"].get(kind, {}).get(name)
        mem = results["memory"].get(name, {}).get(kind) or {}
        periodic = bool(every and every > 1)
        amortised = _fmt(row.get("ratio_amortised"), ".3f") + ("†" if row.get("amortised_borrowed") else "")
        rss, rss0 = mem.get("rss_peak_mib"), base_mem.get("rss_peak_mib")
        delta = f" ({rss - rss0:+.0f})" if rss is not None and rss0 is not None else ""
        lines.append(
            f"| {name} | {_fmt(row['ms'], '.1f')} | {_fmt(row['ratio'], '.3f')}"
            f" | {row['ratio_min']:.2f}–{row['ratio_max']:.2f} | {_fmt(row['ratio_cpu'], '.3f')}"
            f" | {_fmt(row['ratio_non_logged'] if periodic else None, '.3f')}"
            f" | {amortised if periodic else '–'}"
            f" | {_transfers(counts, 'logged')} | {_transfers(counts, 'non_logged')}"
            f" | {_fmt(rss, '.0f')}{delta} | {_fmt(mem.get('py_peak_mib'), '.1f')} |"
        )
    return lines


def render(results: dict[str, Any]) -> str:
    m, a = results["machine"], results["args"]
    out = [
        "# lightning_hooks overhead benchmark",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['platform']};"
        f" Python {m['python']}, torch {m['torch']}, lightning {m['lightning']},"
        f" wandb {m['wandb'] or 'not installed'}.",
        "",
        f"Run: {a['rounds']} rounds. Per round every configuration and model runs one `Trainer.fit` of"
        f" {a['warmup']} warm-up + {a['steps']} timed steps (cut to {a['min_steps']} once a fit's timed steps"
        f" pass {a['fit_seconds']} s), in a shuffled order, with a baseline fit ('none') first, last and"
        " after every two others. × none: median over fits of (the fit's median step time / the mean of the"
        " medians of the baseline fits just before and after it). Torch threads:"
        f" {a['threads'] or 'default'}. Host transfers: {a['count_steps']} counted steps per config. Memory: "
        + (f"a fresh subprocess per config, {a['memory_steps']} steps per fit." if results["memory"]
           else "not measured.")
        + f" {results['wall_s']:.0f} s in all.",
        "",
    ]
    out += [f"> {note}" for note in results["notes"]] + ([""] if results["notes"] else [])
    for kind in results["models"]:
        out += [f"## {kind}", "", *_table(results, kind), ""]
    out += ["## Configurations", ""]
    out += [f"- **{name}**: {c['description']}" for name, c in results["configs"].items()]
    out += ["", "† amortised with the every-step configuration's ratio for the logged step (no logged step was"
            " timed: step 0, the logged one, is a warm-up step).", "", "## Targets", "", "```"]
    out += [{True: "PASS ", False: "FAIL ", None: "info "}[ok] + line for ok, line in results["targets"]]
    out += ["```", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "wandb"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _progress(args: argparse.Namespace, message: str) -> None:
    print(f"[{time.perf_counter() - args.t0:5.0f} s] {message}", file=sys.stderr, flush=True)


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


def timed_rounds(configs: dict[str, Config], models: list[str], args: argparse.Namespace, tmp: str) -> Runs:
    """Every configuration and model once per round (and "none" between them), timed step by step."""
    for kind in models:  # first-fit costs (lazy imports, allocator growth) land in an untimed fit
        run_fit(kind, configs["none"], args.warmup + 2, tmp, f"{kind}-warmup")
    runs: Runs = {(kind, r): [] for kind in models for r in range(args.rounds)}
    for r in range(args.rounds):
        for name in round_order(list(configs), r):
            for kind in models:
                timer = StepTimer(args.warmup, args.min_steps + 1, args.fit_seconds)
                run_fit(kind, configs[name], args.warmup + args.steps + 1, tmp, f"{kind}-r{r}", extra=[timer])
                runs[(kind, r)].append((name, timer.durations(args.warmup)))
        _progress(args, f"round {r + 1}/{args.rounds} timed")
    return runs


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
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of mlp,cnn")
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


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    _quiet()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.models, args.memory_steps)))
        return 0

    notes: list[str] = []
    configs = build_configs(notes)
    if args.configs:
        wanted = {"none", "none (A/A)", *(c.strip() for c in args.configs.split(","))}
        if unknown := wanted - set(configs):
            sys.exit(f"unknown config(s) {sorted(unknown)}; available: {list(configs)}")
        configs = {n: c for n, c in configs.items() if n in wanted}
    for note in notes:
        _progress(args, f"note: {note}")
    _progress(args, f"configs: {', '.join(configs)}; models: {', '.join(args.models)}")

    with tempfile.TemporaryDirectory(prefix="lh-bench-") as tmp:
        os.environ["WANDB_DIR"] = tmp
        runs = timed_rounds(configs, args.models, args, tmp)
        transfers: dict[str, dict[str, Any]] = defaultdict(dict)
        for name, cfg in configs.items():
            for kind in args.models:
                if name != "none (A/A)":
                    transfers[kind][name] = count_transfers(kind, cfg, args.count_steps, tmp)
        _progress(args, "host transfers counted")
        _finish_wandb()
    memory: dict[str, Any] = {}
    if not args.no_memory:
        for name in configs:
            if name != "none (A/A)":
                memory[name] = measure_memory(name, args.models, args.memory_steps, args.threads)
        _progress(args, "memory measured")

    timing = analyse(runs, configs, args.models)
    results = {
        "machine": machine(), "models": args.models, "notes": notes,
        "args": {k: getattr(args, k) for k in ARG_NAMES},
        "configs": {n: {"description": c.description, "every": c.every} for n, c in configs.items()},
        "timing": timing, "transfers": transfers, "memory": memory,
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
