"""Feature extraction: train a small classifier on CPU, then save its embeddings with predict.

Runs in a few seconds, writes safetensors shards and a manifest under ``./runs/feature_extraction``
(or the directory given as the first argument), loads them back in dataset order with their sample
ids and checks them against the model, then looks a sample up by its id in the memory-mapped
features and finds its nearest neighbours.

    python examples/feature_extraction.py
"""

from __future__ import annotations

import json
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
    extractor = FeatureExtractor(["encoder.2", "head"], dirpath=features_dir, flush_every_n_batches=4,
                                 model_version="classifier-3-epochs")
    test_set = clusters(200, seed=2)
    # Each row carries its sample's dataset index (from Lightning's batch indices), so rows come back
    # in dataset order even where the sampler reorders them (DDP's, or a shuffled loader).
    L.Trainer(callbacks=[extractor], **quiet).predict(model, DataLoader(test_set, batch_size=16))

    embeddings, ids = load_features(features_dir, "encoder.2", return_ids=True)
    logits = load_features(features_dir, "head")
    manifest = json.loads((features_dir / "predict" / "manifest.json").read_text())
    shards = [shard["file"] for shard in manifest["shards"]]
    print(f"encoder.2: {tuple(embeddings.shape)} from {len(shards)} shards ({shards[0]} ... {shards[-1]});"
          f" ids 0..{ids.max().item()} in dataset order: {torch.equal(ids, torch.arange(len(test_set)))}")
    print(f"head:      {tuple(logits.shape)}; manifest: {manifest['outputs']['head']}")

    x, y = test_set.tensors
    with torch.no_grad():
        same = torch.allclose(embeddings, model.encoder(x), atol=1e-6)
    accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    print(f"saved features equal the encoder's output: {same}; accuracy from saved logits: {accuracy:.2%}")
    if not same:
        raise SystemExit("the saved features do not match the model")
    nearest_neighbours(features_dir, y, query_id=17)


def nearest_neighbours(features_dir: Path, labels: torch.Tensor, query_id: int, k: int = 5) -> None:
    """Look up a sample by its id in the memory-mapped features; find its nearest neighbours by cosine."""
    mapped = load_features(features_dir, "encoder.2", mmap=True)
    query = nn.functional.normalize(mapped.by_id([query_id]), dim=1)
    similarity = nn.functional.normalize(mapped[:], dim=1) @ query[0]
    similarity[mapped.ids == query_id] = -1  # not itself
    best = similarity.topk(k)
    neighbour_ids = mapped.ids[best.indices]
    share = (labels[neighbour_ids] == labels[query_id]).float().mean().item()
    print(f"sample {query_id} (blob {labels[query_id].item()}): nearest {neighbour_ids.tolist()},"
          f" cosine {[round(v, 4) for v in best.values.tolist()]}, {share:.0%} from the same blob")
    if share < 0.8:
        raise SystemExit("the nearest neighbours are not from the query's blob")


if __name__ == "__main__":
    main(*sys.argv[1:2])
