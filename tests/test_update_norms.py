"""GradientMonitor(update_norms=True): the update's norm and Adam's moments' norms at logged steps."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_hooks import GradientMonitor
from tests.helpers import TinyNet, csv_metrics, loader, trainer


class AdamNet(TinyNet):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Truth(L.Callback):
    """Each step's update norm and moments' norms per parameter, as torch has them."""

    def __init__(self) -> None:
        self.steps: list[dict[str, tuple[float, ...]]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        state = trainer.optimizers[0].state
        step = {}
        for name, p in pl_module.named_parameters():
            moments = state.get(p, {})
            step[name] = ((p.detach() - self.before[name]).norm().item(),
                          *((moments["exp_avg"].norm().item(), moments["exp_avg_sq"].sqrt().norm().item())
                            if "exp_avg" in moments else ()))
        self.steps.append(step)


def _logged(tmp_path: Any, model: L.LightningModule) -> tuple[list[dict[str, str]], Truth]:
    truth = Truth()
    monitor = GradientMonitor(update_ratio=True, update_norms=True, log_every_n_steps=2, histogram=False)
    trainer(tmp_path, [monitor, truth], logger=CSVLogger(tmp_path, name="", version=""), max_steps=4).fit(
        model, loader())
    return [r for r in csv_metrics(str(tmp_path)) if r.get("updates/net.0.weight/norm")], truth


def test_adam_rows_get_the_update_and_both_moments_norms_at_logged_steps(tmp_path):
    torch.manual_seed(0)
    rows, truth = _logged(tmp_path, AdamNet())
    assert [int(r["step"]) for r in rows] == [0, 1, 3]
    for row in rows:
        step = int(row["step"])
        for name in ("net.0.weight", "net.2.bias"):
            delta, first, second = truth.steps[step][name]
            assert float(row[f"updates/{name}/norm"]) == pytest.approx(delta, rel=1e-5)
            assert float(row[f"updates/{name}/exp_avg_norm"]) == pytest.approx(first, rel=1e-5)
            assert float(row[f"updates/{name}/exp_avg_sq_sqrt_norm"]) == pytest.approx(second, rel=1e-5)


def test_sgd_rows_get_the_update_norm_and_no_moments(tmp_path):
    torch.manual_seed(0)
    rows, truth = _logged(tmp_path, TinyNet())
    assert float(rows[0]["updates/net.0.weight/norm"]) == pytest.approx(truth.steps[0]["net.0.weight"][0], rel=1e-5)
    assert not any(k.endswith("exp_avg_norm") for row in rows for k, v in row.items() if v)


def test_update_norms_needs_update_ratio():
    with pytest.raises(ValueError, match="update_ratio=True"):
        GradientMonitor(update_norms=True)
