from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from importlib import metadata
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks.callbacks.features import FeatureExtractor, iter_features, load_features
from tests._ddp_features import Encoder as PredictEncoder

HERE = Path(__file__).parent
TRAINER = dict(
    accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)


class Encoder(LightningModule):
    """encoder.0's output is then modified in place by an in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
        self.head = nn.Linear(3, 1)
        self.predicted = 0

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return F.mse_loss(self(batch[0]), batch[0][:, :1])

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self(batch[0])

    test_step = validation_step

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        self.predicted += 1
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def inputs(n: int, seed: int = 1) -> Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def loader(x: Tensor, batch_size: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(x), batch_size=batch_size)


def shard_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_predicted_features_equal_the_layer_outputs(tmp_path: Path) -> None:
    model, x = Encoder(), inputs(20)
    extractor = FeatureExtractor(["encoder.0", "encoder.2"], dirpath=tmp_path, flush_every_n_batches=2)
    Trainer(callbacks=[extractor], **TRAINER).predict(model, loader(x))

    with torch.no_grad():
        before_relu = model.encoder[0](x)  # saved before the in-place ReLU overwrote it
        encoded = model.encoder(x)
    torch.testing.assert_close(load_features(tmp_path, "encoder.0"), before_relu)
    torch.testing.assert_close(load_features(tmp_path, "encoder.2", stage="predict", rank=0), encoded)
    expected = ["manifest.json"] + [f"rank0-shard{k:05d}.safetensors" for k in range(3)]  # 5 batches, 2 a shard
    assert shard_names(tmp_path / "predict") == expected
    assert not extractor.is_attached


def test_the_manifest_describes_the_set(tmp_path: Path) -> None:
    extractor = FeatureExtractor(["encoder.0", "encoder.2"], dirpath=tmp_path, flush_every_n_batches=2,
                                 model_version="v7")
    Trainer(callbacks=[extractor], **TRAINER).predict(Encoder(), loader(inputs(20)))
    manifest = json.loads((tmp_path / "predict" / "manifest.json").read_text())

    assert manifest["complete"] and manifest["stage"] == "predict" and manifest["ranks"] == [0]
    assert manifest["outputs"]["encoder.0"] == {"shape": [8], "dtype": "torch.float32", "rows": 20, "ids": True,
                                                "ranks": [0]}
    assert [s["rows"] for s in manifest["shards"]] == [{"encoder.0": 8, "encoder.2": 8}] * 2 + [
        {"encoder.0": 4, "encoder.2": 4}]
    assert manifest["shards"][0]["ids"] == {"encoder.0": "ids", "encoder.2": "ids"}  # one ids tensor, shared
    for shard in manifest["shards"]:
        data = (tmp_path / "predict" / shard["file"]).read_bytes()
        assert shard["bytes"] == len(data) and shard["crc32"] == zlib.crc32(data)
    assert manifest["watched"] == ["encoder.0", "encoder.2"]
    assert manifest["model"]["class"].endswith("test_features.Encoder") and manifest["model"]["version"] == "v7"
    assert manifest["model"]["parameters"] == 4 * 8 + 8 + 8 * 3 + 3 + 3 + 1
    assert manifest["versions"]["torch"] == metadata.version("torch")
    assert set(manifest["versions"]) == {"lightning-hooks", "torch", "lightning", "safetensors"}


def test_sample_ids_from_the_batch_work_in_any_stage(tmp_path: Path) -> None:
    model, x = Encoder(), inputs(12)
    keys = torch.randperm(12, generator=torch.Generator().manual_seed(0)) + 1000  # the dataset's own ids
    extractor = FeatureExtractor("encoder.2", dirpath=tmp_path, stages="validate", sample_ids=lambda batch: batch[1])
    Trainer(callbacks=[extractor], **TRAINER).validate(model, DataLoader(TensorDataset(x, keys), batch_size=4))
    features, ids = load_features(tmp_path, "encoder.2", stage="validate", return_ids=True)
    assert torch.equal(ids, torch.arange(1000, 1012))
    with torch.no_grad():
        torch.testing.assert_close(features, model.encoder(x[keys.argsort()]))


@pytest.mark.filterwarnings("ignore:Your `predict_dataloader`'s sampler has shuffling enabled")
def test_rows_come_back_in_dataset_order_from_a_shuffled_loader(tmp_path: Path) -> None:
    model, x = Encoder(), inputs(30)
    shuffled = DataLoader(TensorDataset(x), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    Trainer(callbacks=[FeatureExtractor("encoder.2", dirpath=tmp_path)], **TRAINER).predict(model, shuffled)

    features, ids = load_features(tmp_path, "encoder.2", return_ids=True)
    assert torch.equal(ids, torch.arange(30))
    with torch.no_grad():
        torch.testing.assert_close(features, model.encoder(x))
    saved_order = torch.cat([rows for rows, _ in iter_features(tmp_path, "encoder.2")])
    assert not torch.equal(saved_order, features)  # the loader did shuffle


class Watched(FeatureExtractor):
    """Notes how many batches the buffer holds at each batch end, before it may flush."""

    held: list[int]

    def on_predict_batch_end(self, trainer: Trainer, *args: object) -> None:
        self.held.append(self.buffered_batches)
        super().on_predict_batch_end(trainer, *args)
        self.held.append(self.buffered_batches)


def test_memory_stays_bounded_by_the_flush_size(tmp_path: Path) -> None:
    extractor = Watched("encoder.2", dirpath=tmp_path, flush_every_n_batches=4)
    extractor.held = []
    Trainer(callbacks=[extractor], **TRAINER).predict(Encoder(), loader(inputs(80), batch_size=2))

    assert len(extractor.held) == 80 and max(extractor.held) == 4
    assert extractor.held[-1] == 0
    assert shard_names(tmp_path / "predict")[1:] == [f"rank0-shard{k:05d}.safetensors" for k in range(10)]
    assert load_features(tmp_path, "encoder.2").shape == (80, 3)


def test_a_new_run_replaces_the_shards_of_the_last_one(tmp_path: Path) -> None:
    model, extractor = Encoder(), FeatureExtractor("encoder.2", dirpath=tmp_path, flush_every_n_batches=1)
    trainer = Trainer(callbacks=[extractor], **TRAINER)
    trainer.predict(model, loader(inputs(20)))
    assert len(shard_names(tmp_path / "predict")) == 5 + 1
    trainer.predict(model, loader(inputs(8, seed=2)))
    assert shard_names(tmp_path / "predict") == ["manifest.json", "rank0-shard00000.safetensors",
                                                 "rank0-shard00001.safetensors"]
    with torch.no_grad():
        torch.testing.assert_close(load_features(tmp_path, "encoder.2"), model.encoder(inputs(8, seed=2)))


def test_shards_of_ranks_that_no_longer_exist_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / "predict" / "rank3-shard00000.safetensors"
    stale.parent.mkdir(parents=True)
    save_file({"features/encoder.2": torch.zeros(5, 3)}, stale, metadata={"rank": "3", "shard": "0", "dataloader": "0"})
    model = Encoder()
    Trainer(callbacks=[FeatureExtractor("encoder.2", dirpath=tmp_path)], **TRAINER).predict(model, loader(inputs(8)))
    assert shard_names(stale.parent) == ["manifest.json", "rank0-shard00000.safetensors"]
    assert load_features(tmp_path, "encoder.2").shape == (8, 3)


class Checkpointed(Encoder):
    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.utils.checkpoint.checkpoint(self.encoder, x, use_reentrant=False)
        return self.head(hidden)


def test_gradient_checkpointing_recomputation_is_not_saved_twice(tmp_path: Path) -> None:
    model, x = Checkpointed(), inputs(12)
    # encoder.0 is recomputed in backward (encoder.2 is not: recomputation stops early).
    extractor = FeatureExtractor("encoder.0", dirpath=tmp_path, stages="train")
    trainer = Trainer(max_epochs=1, callbacks=[extractor], **TRAINER)
    trainer.fit(model, loader(x))
    assert load_features(tmp_path, "encoder.0", "train").shape == (12, 8)


def test_only_enabled_stages_extract_and_never_the_validation_inside_fit(tmp_path: Path) -> None:
    model, extractor = Encoder(), FeatureExtractor("encoder.2", dirpath=tmp_path, stages="validate")
    trainer = Trainer(max_epochs=1, num_sanity_val_steps=2, callbacks=[extractor], **TRAINER)
    trainer.fit(model, loader(inputs(8)), loader(inputs(12, seed=2)))
    trainer.predict(model, loader(inputs(8)))
    assert not (tmp_path / "train").exists() and not (tmp_path / "predict").exists()
    assert not any((tmp_path / "validate").rglob("*.safetensors"))

    trainer.validate(model, loader(inputs(12, seed=2)))
    with torch.no_grad():
        expected = model.encoder(inputs(12, seed=2))
    torch.testing.assert_close(load_features(tmp_path, "encoder.2", "validate"), expected)


def test_fit_stage_saves_training_batches_only(tmp_path: Path) -> None:
    model, x = Encoder(), inputs(12)
    extractor = FeatureExtractor("encoder.2", dirpath=tmp_path, stages=("train", "test"))
    trainer = Trainer(max_epochs=2, callbacks=[extractor], **TRAINER)
    trainer.fit(model, loader(x), loader(inputs(8, seed=2)))
    assert load_features(tmp_path, "encoder.2", "train").shape == (2 * 12, 3)  # two epochs, no validation rows
    trainer.test(model, loader(inputs(8, seed=2)))
    assert load_features(tmp_path, "encoder.2", "test").shape == (8, 3)


def test_hooks_live_only_during_the_stage_and_user_hooks_survive(tmp_path: Path) -> None:
    model = Encoder()
    model.encoder[2].register_forward_hook(lambda module, args, output: None)
    extractor = FeatureExtractor(["encoder.0", "encoder.2"], dirpath=tmp_path)
    counts: list[int] = []

    class Count(FeatureExtractor):
        def on_predict_batch_end(self, trainer: Trainer, *args: object) -> None:
            counts.append(len(model.encoder[2]._forward_hooks))

    counter = Count("head", dirpath=tmp_path / "other")
    Trainer(callbacks=[extractor, counter], **TRAINER).predict(model, loader(inputs(8)))
    assert counts == [2, 2]
    assert len(model.encoder[2]._forward_hooks) == 1 and len(model.encoder[0]._forward_hooks) == 0


def test_embedding_samples_go_to_the_tensorboard_projector(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path / "logs", name="", version="")
    extractor = FeatureExtractor("encoder.0", dirpath=tmp_path / "x", embedding_samples=5, flush_every_n_batches=2)
    trainer = Trainer(callbacks=[extractor], **{**TRAINER, "logger": logger})
    trainer.predict(Encoder(), loader(inputs(20)))
    logger.experiment.flush()

    [tensors] = (tmp_path / "logs").rglob("tensors.tsv")
    rows = [line.split("\t") for line in tensors.read_text().splitlines()]
    assert len(rows) == 5 and all(len(r) == 8 for r in rows)
    assert "features/predict/encoder.0" in (tmp_path / "logs" / "projector_config.pbtxt").read_text()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"modules": None}, ValueError, "`modules` is required"),
        ({"modules": 3}, TypeError, "`modules` must be None, a name glob"),
        ({"dirpath": ""}, ValueError, "`dirpath` is empty: pass a directory"),
        ({"dirpath": 3}, TypeError, r"`dirpath` must be a directory path, got 3 \(int\)"),
        ({"stages": ()}, ValueError, r"`stages` is empty: name at least one of \['train', 'validate', 'test'"),
        ({"stages": {"predict"}}, TypeError, r"`stages` must be a list of names from \['train', .*, got \{'predict'\}"),
        ({"stages": ("predict", "fitting")}, ValueError, r"unknown stage\(s\) \['fitting'\] in `stages`; choose from"),
        ({"flush_every_n_batches": 0}, ValueError, "`flush_every_n_batches` must be a positive int, got 0"),
        ({"flush_every_n_batches": 2.0}, TypeError, r"`flush_every_n_batches` must be a positive int, got 2.0 \(float"),
        ({"embedding_samples": -1}, ValueError, "`embedding_samples` must be a non-negative int, got -1"),
        ({"reduce": "sum"}, ValueError, r"`reduce` must be one of \['mean', 'cls', 'max'\], a callable or None"),
        ({"reduce": 1}, TypeError, r"`reduce` must be one of .* got 1 \(int\): pass e.g. reduce='mean'"),
        ({"reduce_dim": 0}, ValueError, r"`reduce_dim` must name dims from 1 up \(dim 0 holds the samples\)"),
        ({"reduce_dim": [1]}, TypeError, r"`reduce_dim` must be an int or a tuple of ints, got \[1\]"),
        ({"dtype": "float61"}, TypeError, r"`dtype` must be a torch.dtype, its name or None, got 'float61' \(str\)"),
        ({"dtype": "nn"}, TypeError, r"`dtype` must be a torch.dtype, its name or None, got 'nn' \(str\)"),
        ({"max_rows": 0}, ValueError, "`max_rows` must be a positive int, or None for no limit, got 0"),
        ({"sample_ids": "id"}, TypeError, r"`sample_ids` must be a function of the batch or None, got 'id'"),
        ({"model_version": 3}, TypeError, "`model_version` must be a str or None, got 3"),
    ],
)
def test_bad_arguments_raise_in_the_constructor(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        FeatureExtractor(**{"modules": "encoder.0", "dirpath": "features", **kwargs})


def test_a_pattern_matching_nothing_fails_before_any_batch(tmp_path: Path) -> None:
    model, trainer = Encoder(), Trainer(callbacks=[FeatureExtractor("encoder.3", dirpath=tmp_path)], **TRAINER)
    with pytest.raises(ValueError, match=r"'encoder.3' matched no module. Did you mean"):
        trainer.predict(model, loader(inputs(4)))
    assert model.predicted == 0 and not any(tmp_path.iterdir())


def test_load_features_names_the_layers_that_were_saved(tmp_path: Path) -> None:
    extractor = FeatureExtractor("encoder.*", dirpath=tmp_path)
    Trainer(callbacks=[extractor], **TRAINER).predict(Encoder(), loader(inputs(8)))
    with pytest.raises(FileNotFoundError, match=r"for 'head' .* Outputs saved for 'predict': \['encoder.0'"):
        load_features(tmp_path, "head")
    with pytest.raises(FileNotFoundError, match="No features saved by rank 1 for 'encoder.0'"):
        load_features(tmp_path, "encoder.0", rank=1)


class WithUnused(Encoder):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(3, 1)  # never called


def test_load_features_tells_a_layer_never_called_from_one_never_watched(tmp_path: Path) -> None:
    extractor = FeatureExtractor(["encoder.0", "encoder.2", "unused"], dirpath=tmp_path)
    Trainer(callbacks=[extractor], **TRAINER).predict(WithUnused(), loader(inputs(8)))
    saved = r"Outputs saved for 'predict': \['encoder.0', 'encoder.2'\]$"  # not 'unused': nothing is in it
    with pytest.raises(FileNotFoundError, match=r"for 'unused' .*: it was watched, but no output of it was saved"
                                                 r" \(the module was never called\). " + saved):
        load_features(tmp_path, "unused")
    with pytest.raises(FileNotFoundError, match=r"Did you mean: 'encoder.0', 'encoder.2'\? " + saved):
        load_features(tmp_path, "encoder.O")  # the closest first


@pytest.mark.slow
def test_ddp_rows_come_back_in_dataset_order_with_ids(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(HERE / "_ddp_features.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = torch.load(tmp_path / "inputs.pt")
    model = PredictEncoder()
    model.load_state_dict(saved["state"])
    layer = model.encoder
    folder = tmp_path / "features" / "predict"
    # 30 samples shuffled over 2 ranks: 15 each, 4 batches a rank, 2 batches a shard.
    assert shard_names(folder) == ["manifest.json"] + [f"rank{r}-shard{k:05d}.safetensors" for r in (0, 1)
                                                       for k in range(2)]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["ranks"] == [0, 1] and manifest["outputs"]["encoder.2"]["ranks"] == [0, 1]
    features, ids = load_features(tmp_path / "features", "encoder.2", return_ids=True)
    assert torch.equal(ids, torch.arange(30))
    with torch.no_grad():
        torch.testing.assert_close(features, layer(saved["x"]))
    rank1, ids1 = load_features(tmp_path / "features", "encoder.2", rank=1, return_ids=True)
    assert len(ids1) == 15 and torch.equal(ids1, ids1.sort().values)
    with torch.no_grad():
        torch.testing.assert_close(rank1, layer(saved["x"][ids1]))
    assert not torch.equal(ids1, torch.arange(1, 30, 2))  # the sampler shuffled: not the dataset's order
