from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks.callbacks.features import FeatureExtractor, load_features

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
    expected = ["rank0-shard00000.pt", "rank0-shard00001.pt", "rank0-shard00002.pt"]  # 5 batches, 2 a shard
    assert shard_names(tmp_path / "predict" / "encoder.2") == expected
    assert not extractor.is_attached


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
    assert shard_names(tmp_path / "predict" / "encoder.2") == [f"rank0-shard{k:05d}.pt" for k in range(10)]
    assert load_features(tmp_path, "encoder.2").shape == (80, 3)


def test_a_new_run_replaces_the_shards_of_the_last_one(tmp_path: Path) -> None:
    model, extractor = Encoder(), FeatureExtractor("encoder.2", dirpath=tmp_path, flush_every_n_batches=1)
    trainer = Trainer(callbacks=[extractor], **TRAINER)
    trainer.predict(model, loader(inputs(20)))
    assert len(shard_names(tmp_path / "predict" / "encoder.2")) == 5
    trainer.predict(model, loader(inputs(8, seed=2)))
    assert shard_names(tmp_path / "predict" / "encoder.2") == ["rank0-shard00000.pt", "rank0-shard00001.pt"]
    with torch.no_grad():
        torch.testing.assert_close(load_features(tmp_path, "encoder.2"), model.encoder(inputs(8, seed=2)))


def test_shards_of_ranks_that_no_longer_exist_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / "predict" / "encoder.2" / "rank3-shard00000.pt"
    stale.parent.mkdir(parents=True)
    torch.save(torch.zeros(5, 3), stale)
    model = Encoder()
    Trainer(callbacks=[FeatureExtractor("encoder.2", dirpath=tmp_path)], **TRAINER).predict(model, loader(inputs(8)))
    assert shard_names(stale.parent) == ["rank0-shard00000.pt"]
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
    assert not any((tmp_path / "validate").rglob("*.pt"))

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


class Structured(nn.Module):
    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"mask": x > 0, "value": 2 * x}


class Ragged(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x[:, : 1 + int(x.shape[0] % 3)]


class Zoo(Encoder):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.structured, self.ragged = nn.LSTM(4, 5, batch_first=True), Structured(), Ragged()

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x = batch[0]
        self.lstm(x[:, None])
        self.ragged(x)
        return self.structured(x)["value"]


def test_structured_outputs_save_their_first_tensor_and_ragged_ones_are_skipped(tmp_path: Path) -> None:
    model, x = Zoo(), inputs(7)
    extractor = FeatureExtractor(["lstm", "structured", "ragged"], dirpath=tmp_path)
    with pytest.warns(UserWarning) as record:
        Trainer(callbacks=[extractor], **TRAINER).predict(model, loader(x))
    messages = [str(w.message) for w in record]
    assert sum("'lstm' returns a tuple; saving its first tensor, of shape (4, 1, 5)" in m
               for m in messages) == 1
    assert sum("'structured' returns a dict; saving its first tensor" in m for m in messages) == 1
    assert any("'ragged' raised ValueError: its output shape (3, 1) differs" in m for m in messages)
    with torch.no_grad():
        torch.testing.assert_close(load_features(tmp_path, "lstm"), model.lstm(x[:, None])[0])
    assert torch.equal(load_features(tmp_path, "structured"), x > 0)
    assert load_features(tmp_path, "ragged").shape == (4, 2)  # the first batch only


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
    with pytest.raises(FileNotFoundError, match=r"layer 'head' .* Layers saved for 'predict': \['encoder.0'"):
        load_features(tmp_path, "head")
    with pytest.raises(FileNotFoundError, match="No features saved by rank 1 for layer 'encoder.0'"):
        load_features(tmp_path, "encoder.0", rank=1)


class WithUnused(Encoder):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(3, 1)  # never called


def test_load_features_tells_a_layer_never_called_from_one_never_watched(tmp_path: Path) -> None:
    extractor = FeatureExtractor(["encoder.0", "encoder.2", "unused"], dirpath=tmp_path)
    Trainer(callbacks=[extractor], **TRAINER).predict(WithUnused(), loader(inputs(8)))
    saved = r"Layers saved for 'predict': \['encoder.0', 'encoder.2'\]$"  # not 'unused': nothing is in it
    with pytest.raises(FileNotFoundError, match=r"layer 'unused' .*: it was watched, but no output of it was saved"
                                                 r" \(the module was never called\). " + saved):
        load_features(tmp_path, "unused")
    with pytest.raises(FileNotFoundError, match=r"Did you mean: 'encoder.0', 'encoder.2'\? " + saved):
        load_features(tmp_path, "encoder.O")  # the closest first


@pytest.mark.slow
def test_each_ddp_rank_writes_its_own_shards(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(HERE / "_ddp_features.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = torch.load(tmp_path / "inputs.pt")
    layer = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    layer.load_state_dict({k.removeprefix("encoder."): v for k, v in saved["state"].items()})
    expected = [f"rank{r}-shard{k:05d}.pt" for r in (0, 1) for k in range(2)]  # 4 batches a rank, 2 a shard
    assert shard_names(tmp_path / "features" / "predict" / "encoder.2") == expected
    with torch.no_grad():
        for rank in (0, 1):  # the distributed sampler deals samples out round-robin
            torch.testing.assert_close(load_features(tmp_path / "features", "encoder.2", rank=rank),
                                       layer(saved["x"][rank::2]))
    assert load_features(tmp_path / "features", "encoder.2").shape == (32, 3)
