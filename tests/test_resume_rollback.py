"""What a rollback leaves to read (``last_rollback``) survives a resume from a checkpoint."""

from __future__ import annotations

from torch.utils.data import DataLoader

from lightning_hooks import GradientAnomalyStopping
from tests.helpers import trainer
from tests.test_rollback import BAD_BATCH, BATCH, EVERY, SKIP, STEPS, AdamNet, dataset


def test_last_rollback_is_kept_in_the_checkpoint_and_read_back_on_resume(tmp_path):
    def stopper() -> GradientAnomalyStopping:
        return GradientAnomalyStopping(action="rollback", norm_threshold=1e3, rollback_every_n_steps=EVERY,
                                       skip_batches=SKIP, prog_bar=False)

    first, data = stopper(), DataLoader(dataset("spike"), batch_size=BATCH)
    fit = trainer(tmp_path, [first], logger=False, max_steps=STEPS - 2)
    fit.fit(AdamNet(), data)
    assert first.last_rollback == (BAD_BATCH, 6)
    fit.save_checkpoint(tmp_path / "last.ckpt")
    resumed = stopper()
    trainer(tmp_path, [resumed], logger=False, max_steps=STEPS).fit(AdamNet(), data, ckpt_path=tmp_path / "last.ckpt")
    assert (resumed.rollbacks, resumed.last_rollback) == (1, (BAD_BATCH, 6))
