"""UpdateTransform in the training loops that bend the step: AMP, GradientAnomalyStopping, LBFGS."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from lightning.pytorch.plugins import MixedPrecision

from lightning_hooks import GradientAnomalyStopping, UpdateTransform
from tests.helpers import ManualOptimization, loader, trainer
from tests.test_lbfgs import LBFGSNet, StepStarts
from tests.update_helpers import BackboneHead, NaNAtStep, Updates, data, fit, largest_difference


def test_a_step_the_amp_scaler_skips_is_left_alone(tmp_path):
    runs, scalers = [], []
    for model, callbacks in ((BackboneHead("adamw"), [UpdateTransform(scale={"backbone": 0.1})]),
                             (BackboneHead("adamw", backbone_lr=0.1), [])):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # fp16 overflows at first: skipped steps
        amp = MixedPrecision("16-mixed", "cpu", scaler=scaler)
        runs.append(fit(tmp_path, model, callbacks, steps=30, plugins=[amp]))
        scalers.append(scaler.get_scale())
    assert scalers[0] == scalers[1] < 2.0**30  # both backed off through the same skipped steps
    assert largest_difference(*runs) < 1e-5


@pytest.mark.parametrize("action", ["skip", "rollback"])
@pytest.mark.parametrize("transform_first", [True, False])
def test_a_dropped_update_is_left_alone_and_not_remembered(tmp_path, action, transform_first):
    runs = []
    for backbone_lr, transform in ((1.0, UpdateTransform(scale={"backbone": 0.1}, clip_to_history="*",
                                                         history_sigmas=1e6)), (0.1, None)):
        stopper = GradientAnomalyStopping(action=action, prog_bar=False)
        callbacks = [c for c in ((transform, stopper) if transform_first else (stopper, transform)) if c]
        runs.append(fit(tmp_path, NaNAtStep("adamw", backbone_lr, nan_step=10), callbacks, steps=30))
        assert stopper.dropped_steps == 1
        if transform is not None:  # 30 steps, one dropped; a rollback also takes back those since its snapshot
            # (read a step late: the NaN step's own update too, and it drops the next one instead)
            discarded = 11 - stopper._rollback.snapshot_step if action == "rollback" else 0
            assert (~transform._rewrite.histories[0].norms.isnan()).sum() == 29 - discarded
    assert largest_difference(*runs) < 5e-6


@pytest.mark.parametrize("transform_first", [True, False])
def test_a_rollback_restores_the_norm_history_of_its_snapshot(tmp_path, transform_first):
    transform = UpdateTransform(clip_to_history="*", history_window=64)
    stopper = GradientAnomalyStopping(action="rollback", rollback_every_n_steps=4, prog_bar=False)
    callbacks = [transform, stopper] if transform_first else [stopper, transform]
    fit(tmp_path, NaNAtStep("adamw", nan_step=10), callbacks, steps=13)  # no new snapshot after the rollback
    rollback = stopper._rollback
    assert rollback.returns == [10] and rollback.snapshot_step is not None and rollback.snapshot_step < 10
    discarded = 11 - rollback.snapshot_step  # the updates since the snapshot, the NaN one's too (read a step late)
    # 13 steps, the one after the NaN one dropped, and the discarded ones' norms gone with them.
    assert (~transform._rewrite.histories[0].norms.isnan()).sum() == 13 - 1 - discarded


def test_lbfgs_gets_its_whole_step_scaled(tmp_path):
    deltas = []
    for callbacks in ([], [UpdateTransform(scale={"net.2": 0.5})]):
        torch.manual_seed(0)
        updates = Updates()
        trainer(tmp_path, [*callbacks, updates], logger=False, max_steps=1).fit(LBFGSNet(), loader())
        deltas.append(updates.deltas[0])
    assert torch.allclose(deltas[1]["net.2.weight"], 0.5 * deltas[0]["net.2.weight"], atol=1e-7)
    assert torch.equal(deltas[1]["net.0.weight"], deltas[0]["net.0.weight"])  # not selected: as LBFGS made it
    assert deltas[0]["net.2.weight"].abs().max() > 1e-3


@pytest.mark.parametrize("transform_first", [True, False])
def test_an_lbfgs_step_dropped_at_its_second_closure_call_is_undone_whole(tmp_path, transform_first):
    torch.manual_seed(0)
    starts, stopper = StepStarts(), GradientAnomalyStopping(action="skip", prog_bar=False)
    transform = UpdateTransform(scale={"net.2": 0.5}, max_ratio={"net.0": 0.01})
    callbacks = [transform, stopper] if transform_first else [stopper, transform]
    trainer(tmp_path, [*callbacks, starts], logger=False, max_steps=4).fit(LBFGSNet(nan_at=((1, 2),)), loader())
    assert stopper.dropped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(starts.params[1], starts.params[2]))
    assert not all(torch.equal(a, b) for a, b in zip(starts.params[2], starts.params[3]))  # and trains on


class Manual(ManualOptimization, BackboneHead):
    """BackboneHead (AdamW) with manual optimization."""


def test_manual_optimization_gets_its_steps_scaled(tmp_path):
    scaled = fit(tmp_path, Manual(), [UpdateTransform(scale={"backbone": 0.1})], steps=20)
    reference = fit(tmp_path, Manual(backbone_lr=0.1), steps=20)
    assert largest_difference(scaled, reference) < 5e-6
    assert largest_difference(fit(tmp_path, Manual(), steps=20), reference) > 1e-2


class OnlyTrainable(BackboneHead):
    """BackboneHead whose optimizer takes only what requires grad (the backbone joins when unfrozen)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("transform_first", [True, False])
def test_a_backbone_unfrozen_later_by_backbone_finetuning_is_transformed_from_then_on(tmp_path, transform_first):
    runs = []
    for ratio, transform in ((1.0, UpdateTransform(scale={"backbone": 0.1}, max_ratio={"backbone": 1.0})),
                             (0.1, None)):
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=ratio,
                                        should_align=False, verbose=False)
        callbacks = [c for c in ((transform, finetuning) if transform_first else (finetuning, transform)) if c]
        model = OnlyTrainable("adamw")
        start = model.backbone[0].weight.detach().clone()
        trainer(tmp_path, callbacks, max_epochs=3, max_steps=-1, logger=False).fit(model, data(n=64))
        assert not torch.equal(model.backbone[0].weight, start)  # unfrozen at epoch 1: it trained
        runs.append({name: p.detach().clone() for name, p in model.named_parameters()})
    assert largest_difference(*runs) < 5e-6  # the added group's update scaled: its lr times 0.1
