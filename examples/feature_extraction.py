"""Feature extraction: train a small classifier on CPU, then save its embeddings with predict.

Runs in a few seconds, writes shards under ``./runs/feature_extraction`` (or the directory
given as the first argument), loads them back and checks them against the model.

    python examples/feature_extraction.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from _quiet import quiet_lightning  # Lightning's own noise, silenced by message (see _quiet.py)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import FeatureExtractor, load_features


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(dim=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def clusters(n: int, seed: int) -> TensorDataset:
    """Four Gaussian blobs in 16 dimensions, labelled by blob."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 3
    y = torch.randint(0, 4, (n,), generator=generator)
    return TensorDataset(centers[y] + torch.randn(n, 16, generator=generator), y)


def main(out_dir: str = "runs/feature_extraction") -> None:
    quiet_lightning()
    L.seed_everything(0)
    model = Classifier()
    quiet = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
        enable_progress_bar=False,
    )
    train_loader = DataLoader(clusters(512, seed=1), batch_size=32, shuffle=True)
    L.Trainer(max_epochs=3, **quiet).fit(model, train_loader)

    features_dir = Path(out_dir) / "features"
    extractor = FeatureExtractor(["encoder.2", "head"], dirpath=features_dir, flush_every_n_batches=4)
    test_set = clusters(200, seed=2)
    L.Trainer(callbacks=[extractor], **quiet).predict(model, DataLoader(test_set, batch_size=16))

    embeddings, logits = load_features(features_dir, "encoder.2"), load_features(features_dir, "head")
    shards = sorted(p.name for p in (features_dir / "predict" / "encoder.2").iterdir())
    print(f"encoder.2: {tuple(embeddings.shape)} from {len(shards)} shards ({shards[0]} ... {shards[-1]})")
    print(f"head:      {tuple(logits.shape)}")

    x, y = test_set.tensors
    with torch.no_grad():
        same = torch.allclose(embeddings, model.encoder(x), atol=1e-6)
    accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    print(f"saved features equal the encoder's output: {same}; accuracy from saved logits: {accuracy:.2%}")
    if not same:
        raise SystemExit("the saved features do not match the model")


if __name__ == "__main__":
    main(*sys.argv[1:2])
