"""GradientMonitor on fine-tuning recipes: its rows follow what the optimizers train, and a frozen selection warns."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn

from lightning_hooks import GradientMonitor
from tests.helpers import events, loader, trainer


class Finetuned(L.LightningModule):
    """A backbone and a head; the backbone frozen unless ``frozen=False`` (BackboneFinetuning freezes it itself)."""

    def __init__(self, frozen: bool = True) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.backbone.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:  # as Lightning's fine-tuning docs: only what is trainable now
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


def _norm_steps(tmp_path: Any, tag: str) -> list[int]:
    acc = events(str(tmp_path))
    return [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


@pytest.mark.parametrize("modules", ["backbone", "backbone.1"], ids=["frozen backbone", "a ReLU"])
def test_a_selection_with_nothing_trained_warns_before_training_and_the_run_goes_on(tmp_path, modules):
    monitor = GradientMonitor(modules, log_every_n_steps=1)
    with pytest.warns(UserWarning, match=rf"GradientMonitor: no parameter of {modules!r}.* is trained"):
        trainer(tmp_path, [monitor], max_steps=4).fit(Finetuned(), loader())
    assert _norm_steps(tmp_path, "gradients/total_norm") == [0, 1, 2, 3]  # the head's step is still checked
    assert not [t for t in events(str(tmp_path)).Tags()["scalars"] if t.startswith("gradients/backbone")]


@pytest.mark.parametrize("modules", [None, "backbone"], ids=["every parameter", "the backbone"])
def test_backbone_finetuning_the_backbone_gets_rows_once_it_is_unfrozen(tmp_path, modules):
    # 8 steps an epoch; Lightning's BackboneFinetuning unfreezes the backbone at epoch 1 and adds a param group.
    monitor = GradientMonitor(modules, log_every_n_steps=1, stats=("norm", "max"))
    callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1), monitor]
    trainer(tmp_path, callbacks, max_steps=16).fit(Finetuned(frozen=False), loader())
    assert _norm_steps(tmp_path, "gradients/backbone.0.weight/norm") == list(range(8, 16))
    assert _norm_steps(tmp_path, "gradients/backbone.0.bias/max") == list(range(8, 16))
    assert _norm_steps(tmp_path, "gradients/total_norm/group1") == list(range(8, 16))
    if modules is None:
        assert _norm_steps(tmp_path, "gradients/head.weight/norm") == list(range(16))


def test_module_rows_follow_the_unfrozen_backbone(tmp_path):
    monitor = GradientMonitor(["backbone.0", "head"], granularity="module", log_every_n_steps=1)
    callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1), monitor]
    trainer(tmp_path, callbacks, max_steps=16).fit(Finetuned(frozen=False), loader())
    assert _norm_steps(tmp_path, "gradients/backbone.0/norm") == list(range(8, 16))
    assert _norm_steps(tmp_path, "gradients/head/norm") == list(range(16))
