"""GradientAnomalyStopping(action="rollback"): back to the last good state, skip batches, train on; DDP."""

import logging
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_hooks import GradientAnomalyStopping, SpikeTrigger
from tests.helpers import run_ddp, trainer

BATCH = 8
BAD_BATCH, EVERY, SKIP, STEPS = 7, 3, 2, 14  # snapshots before steps 0, 3, 6: step 7 goes back to 6


class AdamNet(L.LightningModule):
    """Linear -> Tanh -> Linear with Adam and a per-step StepLR, so optimizer and scheduler state matter."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TwoOptimizers(AdamNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


def dataset(bad: str, bad_batches: tuple[int, ...] = (BAD_BATCH,), n_batches: int = STEPS) -> TensorDataset:
    """Regression data whose ``bad_batches`` are scaled by 1e6 (``"spike"``) or NaN (``"nan"``)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n_batches * BATCH, 8, generator=gen)
    for b in bad_batches:
        x[b * BATCH : (b + 1) * BATCH] *= 1e6 if bad == "spike" else float("nan")
    return TensorDataset(x, x.sum(1, keepdim=True))


def samples(batches: list[int]) -> list[int]:
    return [i for b in batches for i in range(b * BATCH, (b + 1) * BATCH)]


def run(tmp_path: Any, callbacks: list[L.Callback], data: Any, steps: int, **kwargs: Any) -> tuple[AdamNet, L.Trainer]:
    torch.manual_seed(0)
    model = AdamNet()
    fit = trainer(tmp_path, callbacks, logger=False, max_steps=steps, **kwargs)
    fit.fit(model, DataLoader(data, batch_size=BATCH))
    return model, fit


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"action": "rollback", "rollback_every_n_steps": 0},
         r"`rollback_every_n_steps` must be a positive int or None, got 0"),
        ({"action": "rollback", "skip_batches": -1}, r"`skip_batches` must be a non-negative int, got -1"),
        ({"action": "skip", "rollback_every_n_steps": 5},
         r"`rollback_every_n_steps` and `skip_batches` work with `action='rollback'` only, got action='skip'"),
        ({"action": "stop", "skip_batches": 2}, r"work with `action='rollback'` only, got action='stop'"),
    ],
)
def test_bad_rollback_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientAnomalyStopping(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"action": "rollback", "rollback_every_n_steps": True},
         r"`rollback_every_n_steps` must be a positive int or None, got True \(bool\)"),
        ({"action": "rollback", "skip_batches": 1.0}, r"`skip_batches` must be a non-negative int, got 1.0 \(float\)"),
    ],
)
def test_rollback_settings_of_the_wrong_type_fail_at_construction(kwargs, match):
    with pytest.raises(TypeError, match=match):
        GradientAnomalyStopping(**kwargs)


@pytest.mark.parametrize(("bad", "precision", "late"), [("spike", "32-true", True), ("nan", "32-true", True),
                                                        ("spike", "bf16-mixed", True), ("spike", "32-true", False),
                                                        ("nan", "32-true", False)])
def test_a_rolled_back_run_ends_where_a_run_that_never_saw_the_bad_batches_does(tmp_path, bad, precision, late):
    stopper = GradientAnomalyStopping(action="rollback", norm_threshold=1e3, rollback_every_n_steps=EVERY,
                                      skip_batches=SKIP, prog_bar=False, act_late=late)
    rolled, fit = run(tmp_path, [stopper], dataset(bad), STEPS, precision=precision)
    # Discarded: batch 6 (after the snapshot), the bad batch 7, the batch whose step read it (late), and SKIP more.
    kept = samples([*range(6), *range(BAD_BATCH + late + SKIP + 1, STEPS)])
    control, control_fit = run(tmp_path, [], Subset(dataset(bad), kept), len(kept) // BATCH, precision=precision)
    assert (fit.global_step, stopper.rollbacks, stopper.dropped_steps, stopper.skipping) == (STEPS, 1, 1 + SKIP, 0)
    assert stopper.last_rollback == (BAD_BATCH, 6) and all(torch.isfinite(p).all() for p in rolled.parameters())
    for (name, p), q in zip(rolled.named_parameters(), control.parameters()):
        assert torch.equal(p, q), name
    schedulers = [f.lr_scheduler_configs[0].scheduler for f in (fit, control_fit)]
    assert schedulers[0].last_epoch == schedulers[1].last_epoch == len(kept) // BATCH
    assert fit.optimizers[0].param_groups[0]["lr"] == control_fit.optimizers[0].param_groups[0]["lr"]
    assert stopper._rollback._state == {}  # the host snapshot is freed at the end of fit


@pytest.mark.parametrize("late", [True, False])
def test_a_second_rollback_to_the_same_snapshot_finds_it_untouched(tmp_path, late):
    stopper = GradientAnomalyStopping(action="rollback", norm_threshold=1e3, rollback_every_n_steps=3, act_late=late)
    data = dataset("spike", bad_batches=(5, 8))  # snapshot before step 3; steps 6 and 7 too few for another
    rolled, _ = run(tmp_path, [stopper], data, STEPS)
    kept = [0, 1, 2, *range(9 + late, STEPS)]  # read late, the batch after the bad one is discarded too
    control, _ = run(tmp_path, [], Subset(data, samples(kept)), len(kept))
    assert stopper.rollbacks == 2 and stopper.last_rollback == (8, 3)
    assert all(torch.equal(p, q) for p, q in zip(rolled.parameters(), control.parameters()))


def test_with_accumulation_whole_optimizer_steps_are_rolled_back_and_skipped(tmp_path):
    stopper = GradientAnomalyStopping(action="rollback", norm_threshold=1e3, rollback_every_n_steps=EVERY,
                                      skip_batches=SKIP)
    data = dataset("spike", bad_batches=(2 * BAD_BATCH + 1,), n_batches=2 * STEPS)  # step 7's second micro-batch
    rolled, fit = run(tmp_path, [stopper], data, STEPS, accumulate_grad_batches=2)
    kept = [*range(12), *range(2 * (BAD_BATCH + SKIP + 2), 2 * STEPS)]  # steps 0-5 and 11-13, two batches each
    control, _ = run(tmp_path, [], Subset(data, samples(kept)), len(kept) // 2, accumulate_grad_batches=2)
    assert (fit.global_step, stopper.last_rollback, stopper.dropped_steps) == (STEPS, (BAD_BATCH, 6), 1 + SKIP)
    assert all(torch.equal(p, q) for p, q in zip(rolled.parameters(), control.parameters()))


def test_patience_tolerates_and_the_snapshot_waits_for_clean_steps(tmp_path):
    stopper = GradientAnomalyStopping(action="rollback", norm_threshold=1e3, patience=1, rollback_every_n_steps=2)
    run(tmp_path, [stopper], dataset("spike"), 9)
    assert (stopper.anomalous_steps, stopper.rollbacks, stopper.dropped_steps) == (1, 0, 0)
    # Snapshots before steps 0, 2, 4, 6; step 7 was tolerated, so step 8 alone is not enough for another.
    assert stopper._rollback.snapshot_step == 6 and stopper.last_report is None


def test_state_dict_keeps_the_rollback_counters():
    stopper = GradientAnomalyStopping(action="rollback", skip_batches=3)
    stopper.rollbacks, stopper._rollback.skipping = 2, 1
    state = stopper.state_dict()
    assert (state["rollbacks"], state["skipping"]) == (2, 1)
    resumed = GradientAnomalyStopping(action="rollback", skip_batches=3)
    resumed.load_state_dict(state)
    assert (resumed.rollbacks, resumed.skipping) == (2, 1)


def test_rollback_with_several_optimizers_fails_before_the_first_step(tmp_path):
    stopper = GradientAnomalyStopping(action="rollback")
    with pytest.raises(ValueError, match=r"`action='rollback'` supports one optimizer, got 2"):
        trainer(tmp_path, [stopper], logger=False).fit(TwoOptimizers(), DataLoader(dataset("spike"), batch_size=8))


@pytest.mark.slow
def test_ddp_both_ranks_roll_back_at_the_same_step(tmp_path):
    ranks = run_ddp("_ddp_rollback.py", tmp_path, timeout=90)
    for rank in ranks:  # the NaN was on rank 1 only; rank 0 rolled back with it
        assert rank["rolled_back_at"] == [4] and rank["finite"]
        assert rank["restored"]  # after step 4 the parameters were those from before step 3
        assert (rank["global_step"], rank["dropped_steps"]) == (8, 2)
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["ratio_steps"] == [0, 1, 2, 3, 6, 7]  # no update ratio for dropped updates
    assert [rank["health_images"] for rank in ranks] == [2, 0]  # LayerHealth draws on rank zero only


class Falling(AdamNet):
    """AdamNet's model on batches of 64 with SGD and momentum, no schedule: its loss falls 4x from step 6 to step 11."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


def _spike_run(tmp_path: Any, data: Any, steps: int) -> tuple[Falling, GradientAnomalyStopping]:
    stopper = GradientAnomalyStopping(action="rollback", spikes=SpikeTrigger(window=16, warmup=8), window=8,
                                      relative_threshold=1e6, rollback_every_n_steps=6, skip_batches=2,
                                      flight_recorder=16, prog_bar=False)
    torch.manual_seed(0)
    model = Falling()
    trainer(tmp_path, [stopper], logger=False, max_steps=steps).fit(model, DataLoader(data, batch_size=64))
    return model, stopper


def test_with_spikes_a_rolled_back_run_whose_level_moved_ends_as_one_that_never_saw_the_batches(tmp_path):
    # Snapshots before steps 0 and 6; the loss falls 4x from step 6 to the corrupt batch at step 11. The restored
    # model goes on with the windows, medians and record of step 6, and never sees the discarded steps' values.
    bad, steps = 11, 40
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(steps * 64, 8, generator=gen)
    x[bad * 64 : (bad + 1) * 64] *= 1e3
    data = TensorDataset(x, 0.5 * x[:, :2].sum(1, keepdim=True))
    rolled, stopper = _spike_run(tmp_path, data, steps)
    # Read a step late: step 11's update is applied, then discarded; step 12's and the 2 skipped are dropped.
    kept = [i for b in [*range(6), *range(bad + 4, steps)] for i in range(b * 64, (b + 1) * 64)]
    control, judged = _spike_run(tmp_path, Subset(data, kept), len(kept) // 64)  # never saw steps 6-14
    assert (stopper.rollbacks, stopper.last_rollback, stopper.dropped_steps) == (1, (bad, 6), 3)
    assert (judged.rollbacks, judged.anomalous_steps) == (0, 0)
    assert all(torch.equal(p, q) for p, q in zip(rolled.parameters(), control.parameters()))
    for ring, same in [(stopper._watch.spikes.windows._rings[0], judged._watch.spikes.windows._rings[0]),
                       (stopper._watch.recorders[0].ring, judged._watch.recorders[0].ring)]:
        assert ring.count == same.count == len(kept) // 64  # the discarded steps' values are in neither
        assert torch.equal(ring.ordered(), same.ordered())
    medians = [s._detector.state_dict() for s in (stopper, judged)]  # the running medians' windows too
    assert medians[0]["seen"] == medians[1]["seen"] and torch.equal(*(m["history"][0] for m in medians))


def test_a_second_rollback_to_the_same_snapshot_warns_and_a_third_stops_with_a_report(tmp_path, caplog):
    stopper = GradientAnomalyStopping(action="rollback", norm_threshold=1e3, rollback_every_n_steps=10)
    torch.manual_seed(0)
    initial = [p.detach().clone() for p in AdamNet().parameters()]
    with caplog.at_level(logging.WARNING, logger="lightning_hooks"):
        rolled, fit = run(tmp_path, [stopper], dataset("spike", bad_batches=(5, 8, 11)), STEPS)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and "GradientAnomalyStopping" in r.getMessage()]
    assert any("step 8 rolled back to the state before step 0" in s and "The second rollback" in s for s in said)
    stop = [s for s in said if "stopping at step 11: 3 rollbacks to the state before step 0" in s]
    assert len(stop) == 1 and "steps 5, 8, 11" in stop[0] and "Gradient anomaly at step 11" in stop[0]
    assert fit.global_step == 13 and stopper.rollbacks == 3  # stopped after the third (read at 12), not looping
    assert all(torch.equal(p, q) for p, q in zip(rolled.parameters(), initial))  # left at the snapshot


class Finetuned(L.LightningModule):
    """A backbone that Lightning's BackboneFinetuning unfreezes at epoch 1 (a param group added), and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)


def test_rollback_after_backbone_finetuning_added_a_param_group_goes_back_to_a_snapshot_with_it(tmp_path):
    from lightning.pytorch.callbacks import BackboneFinetuning

    stopper = GradientAnomalyStopping(action="rollback", norm_threshold=1e3, rollback_every_n_steps=100)
    data = dataset("spike", bad_batches=(3,))  # the fourth batch of each epoch: one group in epoch 0, two in 1
    bad = trainer(tmp_path, [BackboneFinetuning(unfreeze_backbone_at_epoch=1), stopper], logger=False,
                  max_epochs=2, max_steps=-1)
    torch.manual_seed(0)
    model = Finetuned()
    bad.fit(model, DataLoader(data, batch_size=BATCH))  # before: ValueError, a different number of param groups
    assert len(bad.optimizers[0].param_groups) == 2  # the backbone's group, added at epoch 1
    assert stopper.rollbacks == 2 and stopper.last_rollback == (STEPS + 3, STEPS)  # to the snapshot with both groups
    assert bad.global_step == 2 * STEPS and all(torch.isfinite(p).all() for p in model.parameters())
