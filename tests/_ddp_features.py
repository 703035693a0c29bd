"""Run by tests/test_features.py: a 2-process CPU DDP predict with FeatureExtractor (gloo), shuffled."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_hooks.callbacks.features import FeatureExtractor  # noqa: E402
from tests.helpers import leave_process_group  # noqa: E402


class Encoder(L.LightningModule):
    """Linear -> ReLU -> Linear on 4 features, for predict (also used by tests/_killed_features.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.encoder(batch[0])


def main(out_dir: str) -> None:
    L.seed_everything(0, verbose=False)
    model = Encoder()
    x = torch.randn(30, 4, generator=torch.Generator().manual_seed(1))  # 30: the sampler pads to 32
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[FeatureExtractor("encoder.2", dirpath=os.path.join(out_dir, "features"), flush_every_n_batches=2)],
    )
    loader = DataLoader(TensorDataset(x), batch_size=4, shuffle=True)  # Lightning's sampler keeps the shuffle
    trainer.predict(model, loader, return_predictions=False)
    if trainer.is_global_zero:
        torch.save({"state": model.state_dict(), "x": x}, os.path.join(out_dir, "inputs.pt"))
    leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
