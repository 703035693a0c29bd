"""A norm's scale judged by its update ratio, end to end: a real fit with an LR raised x100 on a LayerNorm.

Its outputs move a few % and the loss not at all; only its update ratio shows it. LayerHealth names the norm
``too_fast`` at the first logged step after the raise, nothing before, and the Layers tab's banner, replayed
from the event file, names the same layer, problem and step (docs/verdicts.md, "A norm's scale").
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth
from lightning_hooks.output._health_verdicts import Bands
from lightning_hooks.tensorboard_plugin.verdicts import banner, judge
from tests.helpers import run_reader, trainer

ONSET, STEPS = 120, 180


class NormNet(L.LightningModule):
    """Linear -> LayerNorm -> ReLU -> Linear -> ReLU -> Linear under Adam; the LayerNorm in a param group of its own,
    its LR x``boost`` from ``ONSET`` on."""

    def __init__(self, boost: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Linear(32, 1))
        self.boost = boost

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.optimizers().optimizer.param_groups[1]["lr"] = 1e-3 * (self.boost if self.global_step >= ONSET else 1.0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        norm = list(self.net[1].parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in norm)]
        return torch.optim.Adam([{"params": rest}, {"params": norm}], lr=1e-3)


def fit(tmp_path: Any, boost: float) -> tuple[set[tuple[str, str, int]], set[tuple[str, str, int]], str]:
    """LayerHealth's ongoing episodes and the tab's banner, each as (layer, problem, since), and its summary."""
    L.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=gen)
    data = DataLoader(TensorDataset(x, torch.sin(x[:, :1]) + x[:, 1:2] * x[:, 2:3]), batch_size=32, shuffle=True,
                      generator=gen)
    logger = TensorBoardLogger(tmp_path, name="", version=0)
    health = LayerHealth(max_images=1)
    callbacks = [ActivationMonitor(log_every_n_steps=2), GradientMonitor(log_every_n_steps=2, update_ratio=True),
                 health]
    trainer(tmp_path, callbacks, logger=logger, max_steps=STEPS, max_epochs=-1, log_every_n_steps=2).fit(
        NormNet(boost), data)
    logger.experiment.flush()
    reader = run_reader(tmp_path)
    tab = {(b["layer"], b["verdict"], b["since"]) for b in banner(
        judge(reader.figures("version_0"), Bands(), reader.unjudged_ratios("version_0"),
              reader.forward_order("version_0"), reader.scale_ratios("version_0")), Bands())}
    summary = {(layer, problem, e.first) for (problem, layer), e in health._verdicts.episodes.items() if e.ongoing}
    return summary, tab, health.summary()


def test_an_lr_raised_x100_on_a_layernorm_is_named_too_fast_at_once_by_layer_health_and_the_tab(tmp_path):
    summary, tab, text = fit(tmp_path, 100.0)
    assert summary == tab
    first = min(summary, key=lambda episode: episode[2])
    assert first == ("net.1.weight", "too_fast", ONSET + 1), summary  # logged at odd steps: the first after it
    assert {row.rpartition(".weight")[0] or row for row, _, _ in summary} == {"net.1"}, summary  # its own outputs later
    line = next(line for line in text.splitlines() if line.strip().startswith("net.1.weight: learning too fast"))
    assert "its usual" in line and "it was" in line, line  # against its own range, and its first value


def test_the_same_net_without_the_raise_is_healthy(tmp_path):
    summary, tab, _ = fit(tmp_path, 1.0)
    assert summary == tab == set()
