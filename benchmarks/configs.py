"""What the CPU benchmark runs: the models (``WORKLOADS``) and the callback configurations (``build_configs``).

The models: ``mlp`` and ``cnn`` (a few large modules each), and ``gpt2``, ``scaling.py``'s GPT-2-style
decoder built from its sizes (no download), whose 87 small hooked modules are what a
transformer's per-module costs look like.

Adding a model is one entry in ``WORKLOADS``; adding a configuration (or a peer from ``peers.py``)
is one ``Config`` in ``build_configs``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import scaling
import torch
import torch.nn.functional as F
from harness import LOG_EVERY, Config, Workload
from lightning.pytorch.callbacks import Callback
from peers import NaiveHistogramMonitor, WandbWatch
from torch import nn

from lightning_hooks import ActivationMonitor

Batch = tuple[torch.Tensor, torch.Tensor]


class BenchModule(pl.LightningModule):
    """A plain classifier: ``self(x)`` (so module and whole-model hooks fire), cross-entropy, SGD."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(1024, 1024))


def _mlp_batch(gen: torch.Generator) -> Batch:
    return torch.randn(256, 1024, generator=gen), torch.randint(0, 1024, (256,), generator=gen)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10),
    )


def _cnn_batch(gen: torch.Generator) -> Batch:
    return torch.randn(64, 3, 32, 32, generator=gen), torch.randint(0, 10, (64,), generator=gen)


def _seeded(net: Callable[[], nn.Module]) -> BenchModule:
    torch.manual_seed(0)
    return BenchModule(net())


def _repeated(batch: Callable[[torch.Generator], Batch], n: int) -> list[Batch]:
    """``n`` batches in memory (4 distinct ones, repeated), so data loading costs every config alike."""
    gen = torch.Generator().manual_seed(1)
    distinct = [batch(gen) for _ in range(4)]
    return [distinct[i % 4] for i in range(n)]


def _workload(net: Callable[[], nn.Module], batch: Callable[[torch.Generator], Batch]) -> Workload:
    return Workload(functools.partial(_seeded, net), functools.partial(_repeated, batch))


WORKLOADS: dict[str, Workload] = {
    "mlp": _workload(_mlp, _mlp_batch),  # 4 Linear layers of width 1024 with ReLU, batch 256
    "cnn": _workload(_cnn, _cnn_batch),  # 3 conv layers on synthetic 3x32x32 images, batch 64
    # scaling.py's GPT-2-style decoder, built from its sizes: 12 blocks of width 64, 4 heads, 8 x 64 tokens
    "gpt2": scaling.workloads([], decoder=True)["gpt2-style"],
}
MODELS = tuple(WORKLOADS)


def optional(module: str, name: str) -> Any:
    """``module.name``, or None where it cannot be imported (yet)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _accepts(cls: Any, argument: str) -> bool:
    return cls is not None and argument in inspect.signature(cls).parameters


def _every(n: int) -> Callable[[int], bool]:
    return lambda step: step == 0 or (step + 1) % n == 0  # our callbacks log as Lightning does, and at step 0


def _wandb_every(n: int) -> Callable[[int], bool]:
    return lambda step: (step + 1) % n == 0  # watch counts calls from 1 and logs on the n-th


def build_configs(notes: list[str]) -> dict[str, Config]:
    """Every configuration this environment can run; what is missing goes to ``notes``."""
    grad_cls = optional("lightning_hooks.callbacks.gradients", "GradientMonitor")
    stop_cls = optional("lightning_hooks.callbacks.stopping", "GradientAnomalyStopping")
    if grad_cls is None:
        notes.append("GradientMonitor is not importable yet: the monitor rows hold ActivationMonitor only.")
    configs = [
        Config("none", "no callbacks (baseline)", lambda tmp: []),
        Config("none (A/A)", "no callbacks again: the noise floor", lambda tmp: []),
        *_monitor_configs(grad_cls),
        *_quick_start_configs(grad_cls, stop_cls),
        *_provenance_configs(grad_cls, stop_cls, notes),
        Config("naive/1", "naive reference: per-module .cpu() + numpy histogram in forward hooks, every step",
               lambda tmp: [NaiveHistogramMonitor(1)], _every(1), 1),
        Config("detect_anomaly", "Trainer(detect_anomaly=True), i.e. torch.autograd.detect_anomaly",
               lambda tmp: [], trainer_kwargs={"detect_anomaly": True}),
        *_wandb_configs(notes),
    ]
    return {c.name: c for c in configs}


def _monitor_configs(grad_cls: Any) -> list[Config]:
    """ActivationMonitor and GradientMonitor, together and alone, every step and every ``LOG_EVERY``."""

    def monitors(every: int, **grad_kwargs: Any) -> Callable[[str], list[Callback]]:
        def make(tmp: str) -> list[Callback]:
            cbs: list[Callback] = [ActivationMonitor(log_every_n_steps=every)]
            if grad_cls is not None:
                cbs.append(grad_cls(log_every_n_steps=every, **grad_kwargs))
            return cbs
        return make

    names = "ActivationMonitor" + (" + GradientMonitor" if grad_cls is not None else "")
    configs = [
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
    configs.append(Config("activations/1", "ActivationMonitor(log_every_n_steps=1) alone",
                          lambda tmp: [ActivationMonitor(log_every_n_steps=1)], _every(1), 1))
    if grad_cls is not None:
        configs.append(Config("gradients/1", "GradientMonitor(log_every_n_steps=1) alone",
                              lambda tmp: [grad_cls(log_every_n_steps=1)], _every(1), 1))
    return configs


def _quick_start_configs(grad_cls: Any, stop_cls: Any) -> list[Config]:
    """The README's quick start: ActivationMonitor, GradientMonitor and GradientAnomalyStopping(action="skip").

    As written there (logging at the Trainer's ``log_every_n_steps``, ``LOG_EVERY`` here), and logging every step.
    """
    if grad_cls is None or stop_cls is None:
        return []

    def quick_start(every: int) -> Callable[[str], list[Callback]]:
        return lambda tmp: [ActivationMonitor(log_every_n_steps=every), grad_cls(log_every_n_steps=every),
                            stop_cls(action="skip")]

    described = "ActivationMonitor() + GradientMonitor() + GradientAnomalyStopping(action='skip')"
    return [
        Config(f"quick start/{LOG_EVERY}", f"{described}, log_every_n_steps={LOG_EVERY}: the README's quick start",
               quick_start(LOG_EVERY), _every(LOG_EVERY), LOG_EVERY, partner="quick start/1"),
        Config("quick start/1", f"{described}, log_every_n_steps=1", quick_start(1), _every(1), 1),
    ]


def _provenance_configs(grad_cls: Any, stop_cls: Any, notes: list[str]) -> list[Config]:
    """NaN provenance on: in GradientMonitor (logging every ``LOG_EVERY``) and in GradientAnomalyStopping."""
    configs = []
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
    if not configs:
        notes.append("Neither GradientMonitor nor GradientAnomalyStopping takes `provenance` yet: no provenance row.")
    return configs


def _wandb_configs(notes: list[str]) -> list[Config]:
    """``wandb.watch`` every step and every ``LOG_EVERY``, where wandb is installed."""
    if importlib.util.find_spec("wandb") is None:
        notes.append("wandb is not installed (pip install -e .[bench]): the wandb.watch rows are skipped.")
        return []
    return [
        Config("wandb.watch/1", 'wandb.watch(model, log="all", log_freq=1), offline',
               lambda tmp: [WandbWatch(1, tmp)], _wandb_every(1), 1),
        Config(f"wandb.watch/{LOG_EVERY}", f'wandb.watch(model, log="all", log_freq={LOG_EVERY}), offline',
               lambda tmp: [WandbWatch(LOG_EVERY, tmp)], _wandb_every(LOG_EVERY), LOG_EVERY,
               partner="wandb.watch/1"),
    ]
