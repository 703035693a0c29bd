"""Run by tests/test_feature_store.py: a predict that is killed with SIGKILL at batch 25 of 40."""

from __future__ import annotations

import os
import signal
import sys

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks.callbacks.features import FeatureExtractor  # noqa: E402
from tests._ddp_features import Encoder  # noqa: E402


class KilledEncoder(Encoder):
    """The Encoder, its process killed with SIGKILL at batch 25."""

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        if batch_idx == 25:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().predict_step(batch, batch_idx)


if __name__ == "__main__":
    x = torch.randn(640, 4, generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[FeatureExtractor("encoder.2", dirpath=sys.argv[1], flush_every_n_batches=4)])
    trainer.predict(KilledEncoder(), DataLoader(TensorDataset(x), batch_size=16))
