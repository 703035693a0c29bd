"""``action="rollback"`` reads each step's check a step late, with no blocking host read per step.

The step's one transfer is read at the next step (counted by wrapping it, as in
``tests/test_late_reads.py``); a rollback decided there drops the update about to be made,
restores the snapshot at that batch's end, and judges no check measured before the restored
state goes on (the step read late was measured on the discarded state). Read at the end of
training or at a checkpoint, where no batch end follows, the restore is made at once.
"""

from __future__ import annotations

import logging

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Subset

from lightning_hooks import GradientAnomalyStopping, GradientMonitor
from tests._ddp_late import Transfers
from tests.helpers import trainer
from tests.test_rollback import BATCH, STEPS, AdamNet, dataset


def stopper(**kwargs) -> GradientAnomalyStopping:
    return GradientAnomalyStopping(action="rollback", norm_threshold=1e3, prog_bar=False, **kwargs)


def fit(tmp_path, callbacks, bad_batches=(), steps=STEPS, **kwargs):
    torch.manual_seed(0)
    model = AdamNet()
    initial = [p.detach().clone() for p in model.parameters()]
    run = trainer(tmp_path, callbacks, logger=False, max_steps=steps, **kwargs)
    run.fit(model, DataLoader(dataset("spike", bad_batches=bad_batches), batch_size=BATCH))
    return model, initial, run


def test_each_step_is_read_at_the_next_and_a_rollback_is_decided_there(tmp_path, monkeypatch):
    transfers, rollback = Transfers(monkeypatch.setattr), stopper(rollback_every_n_steps=3, skip_batches=1)
    fit(tmp_path, [transfers, rollback], bad_batches=(7,), steps=10)
    assert transfers.reads == [(step, step + 1) for step in range(9)] + [(9, "end")]  # none blocks its own step
    # Step 7 read at 8: updates 8 and 9 dropped (the one read there, skip_batches=1); back to before step 6.
    assert (rollback.rollbacks, rollback.last_rollback, rollback.dropped_steps) == (1, (7, 6), 2)
    assert rollback.last_report.step == 7 and rollback.anomalous_steps == 1  # step 8's check (bad state) not judged


def test_a_bad_last_step_is_rolled_back_at_the_end_of_training(tmp_path, caplog):
    rollback = stopper(rollback_every_n_steps=100)
    with caplog.at_level(logging.INFO, logger="lightning_hooks"):
        model, initial, _ = fit(tmp_path, [rollback], bad_batches=(STEPS - 1,))
    assert rollback.last_rollback == (STEPS - 1, 0) and rollback.dropped_steps == 0  # no update followed it
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial))  # not left with the bad update
    assert any(f"step {STEPS - 1} rolled back to the state before step 0" in r.getMessage() for r in caplog.records)


def test_a_checkpoint_after_a_bad_step_holds_the_restored_state(tmp_path):
    rollback = stopper(rollback_every_n_steps=100)
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    _, initial, _ = fit(tmp_path, [rollback, saver], bad_batches=(4,), steps=5, enable_checkpointing=True)
    (path,) = tmp_path.glob("*.ckpt")
    saved = torch.load(path, weights_only=False)
    assert rollback.last_rollback == (4, 0)  # read and acted on when the checkpoint was taken
    assert all(torch.equal(p, q) for p, q in zip(saved["state_dict"].values(), initial))
    assert saved["optimizer_states"][0]["state"] == {}  # the optimizer's state from before step 0 too


def test_beside_a_monitor_that_reads_its_logged_steps_at_once_the_run_ends_as_one_that_never_saw_the_batches(
        tmp_path):
    # Logged steps 0, 1, 3, 5, 7, 9 ... are read at once, the others a step late: the bad step 7 is read at once, and
    # step 8, passed over (skip_batches=2), is read only at step 9; its update is dropped all the same.
    def run(data, steps):
        rollback = stopper(rollback_every_n_steps=3, skip_batches=2)
        monitor = GradientMonitor(log_every_n_steps=2, histogram=False, prog_bar=False)
        torch.manual_seed(0)
        model = AdamNet()
        trainer(tmp_path, [rollback, monitor], logger=CSVLogger(tmp_path), max_steps=steps).fit(
            model, DataLoader(data, batch_size=BATCH))
        return model, rollback

    data = dataset("spike")
    rolled, rollback = run(data, STEPS)
    assert (rollback.last_rollback, rollback.dropped_steps, rollback._rollback.resume_at) == ((7, 6), 3, 10)
    kept = [i for b in [*range(6), *range(10, STEPS)] for i in range(b * BATCH, (b + 1) * BATCH)]
    control, judged = run(Subset(data, kept), len(kept) // BATCH)
    assert judged.anomalous_steps == 0
    assert all(torch.equal(p, q) for p, q in zip(rolled.parameters(), control.parameters()))


def test_a_third_rollback_held_by_min_steps_says_that_training_goes_on(tmp_path, caplog):
    rollback = stopper(rollback_every_n_steps=10)
    with caplog.at_level(logging.WARNING, logger="lightning_hooks"):
        _, _, run = fit(tmp_path, [rollback], bad_batches=(5, 8, 11), min_steps=STEPS)
    (said,) = [r.getMessage() for r in caplog.records if "3 rollbacks to the state before step 0" in r.getMessage()]
    assert "Lightning's `min_steps=14` is not met: it trains on from that state" in said
    assert rollback.rollbacks == 3 and run.global_step == STEPS  # Lightning kept training, as the warning said
