"""The feature set on disk: complete or refused, truncated shards, full and read-only disks, reading back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks.callbacks.features import FeatureExtractor, MappedFeatures, iter_features, load_features
from lightning_hooks.output._feature_load import _dataset_order
from lightning_hooks.output._feature_reader import Shard
from tests.test_feature_outputs import Tokens
from tests.test_features import TRAINER, Encoder, inputs, loader

HERE = Path(__file__).parent


def extract(dirpath: Path, n: int = 24, **kwargs: object) -> Encoder:
    model = Encoder()
    extractor = FeatureExtractor(["encoder.0", "encoder.2"], dirpath=dirpath, flush_every_n_batches=2, **kwargs)
    Trainer(callbacks=[extractor], **TRAINER).predict(model, loader(inputs(n)))
    return model


def encoded(model: Encoder, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.encoder(x)


@pytest.mark.slow
def test_a_killed_run_is_refused_and_its_whole_shards_read_on_request(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(HERE / "_killed_features.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    with pytest.raises(FileNotFoundError, match=r"incomplete: it has no manifest.json, so the run that wrote it"
                                                 r" did not finish .* 6 whole shards from ranks \[0\]\. Pass"):
        load_features(tmp_path, "encoder.2")
    features, ids = load_features(tmp_path, "encoder.2", return_ids=True, allow_partial=True)
    assert features.shape == (6 * 4 * 16, 3) and torch.equal(ids, torch.arange(384))  # batches 0-23, 4 a shard


def test_a_truncated_shard_is_named_and_skipped_on_request(tmp_path: Path) -> None:
    model = extract(tmp_path)
    shard = tmp_path / "predict" / "rank0-shard00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(FileNotFoundError, match=r"incomplete: 1 of the 3 shards its manifest lists are missing,"
                                                 r" truncated or corrupt: rank0-shard00001.safetensors."):
        load_features(tmp_path, "encoder.2")
    with pytest.warns(UserWarning, match="skipping 1 incomplete shards .*: rank0-shard00001.safetensors"):
        features, ids = load_features(tmp_path, "encoder.2", return_ids=True, allow_partial=True)
    kept = torch.cat([torch.arange(8), torch.arange(16, 24)])
    assert torch.equal(ids, kept)
    torch.testing.assert_close(features, encoded(model, inputs(24)[kept]))

    (tmp_path / "predict" / "manifest.json").unlink()  # and now without a manifest: each header is read
    with pytest.raises(FileNotFoundError, match=r"2 whole shards from ranks \[0\] and 1 truncated ones"
                                                 r" \(rank0-shard00001.safetensors\)"):
        load_features(tmp_path, "encoder.2")
    with pytest.warns(UserWarning, match="skipping 1 incomplete shards"):
        assert torch.equal(load_features(tmp_path, "encoder.2", return_ids=True, allow_partial=True)[1], kept)


def test_verify_checks_each_shard_against_its_checksum(tmp_path: Path) -> None:
    extract(tmp_path)
    shard = tmp_path / "predict" / "rank0-shard00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte, same size: only the checksum tells
    shard.write_bytes(bytes(data))
    assert load_features(tmp_path, "encoder.2").shape == (24, 3)
    with pytest.raises(FileNotFoundError, match=r"1 of the 3 .* corrupt: rank0-shard00002.safetensors"):
        load_features(tmp_path, "encoder.2", verify=True)


def test_one_output_is_read_without_the_others(tmp_path: Path) -> None:
    model = extract(tmp_path)
    shard = tmp_path / "predict" / "rank0-shard00000.safetensors"
    data = bytearray(shard.read_bytes())
    header_size = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8: 8 + header_size])["features/encoder.0"]["data_offsets"]
    data[8 + header_size + begin: 8 + header_size + end] = b"\xff" * (end - begin)  # encoder.0's rows: NaN
    shard.write_bytes(bytes(data))
    for mmap in (False, True):
        torch.testing.assert_close(load_features(tmp_path, "encoder.2", mmap=mmap)[:], encoded(model, inputs(24)))
        assert load_features(tmp_path, "encoder.0", mmap=mmap)[:8].isnan().all()


def test_mmap_reads_rows_by_position_and_by_sample_id(tmp_path: Path) -> None:
    model = extract(tmp_path)
    expected = encoded(model, inputs(24))
    mapped, ids = load_features(tmp_path, "encoder.2", mmap=True, return_ids=True)
    assert isinstance(mapped, MappedFeatures) and mapped.shape == (24, 3) and len(mapped) == 24
    assert torch.equal(ids, torch.arange(24)) and torch.equal(mapped.ids, ids)
    torch.testing.assert_close(mapped[:], expected)
    torch.testing.assert_close(mapped[5], expected[5])
    torch.testing.assert_close(mapped[torch.tensor([23, 0, 9])], expected[[23, 0, 9]])
    torch.testing.assert_close(mapped.by_id([17, 4]), expected[[17, 4]])
    with pytest.raises(KeyError, match=r"sample ids not saved: \[40\]"):
        mapped.by_id([3, 40])
    mapped[:][:] = 0  # rows handed out are copies: the file is untouched
    torch.testing.assert_close(load_features(tmp_path, "encoder.2"), expected)


def test_iter_features_streams_shard_by_shard(tmp_path: Path) -> None:
    model = extract(tmp_path)
    parts = list(iter_features(tmp_path, "encoder.2"))
    assert [len(rows) for rows, _ in parts] == [8, 8, 8]
    assert torch.equal(torch.cat([ids for _, ids in parts]), torch.arange(24))
    torch.testing.assert_close(torch.cat([rows for rows, _ in parts]), encoded(model, inputs(24)))
    with pytest.raises(FileNotFoundError, match="No features saved for 'head'"):
        iter_features(tmp_path, "head")


class TwoLoaders(Encoder):
    def predict_step(self, batch: list[torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0])


def test_each_dataloader_has_its_own_shards_and_ids(tmp_path: Path) -> None:
    model, first, second = TwoLoaders(), inputs(10), inputs(6, seed=2)
    extractor = FeatureExtractor("encoder.2", dirpath=tmp_path, flush_every_n_batches=8)
    Trainer(callbacks=[extractor], **TRAINER).predict(model, [loader(first), loader(second)])
    rows, ids = load_features(tmp_path, "encoder.2", dataloader_idx=1, return_ids=True)
    assert torch.equal(ids, torch.arange(6))
    torch.testing.assert_close(rows, encoded(model, second))
    both, ids = load_features(tmp_path, "encoder.2", return_ids=True)  # by dataloader, then id
    assert torch.equal(ids, torch.cat([torch.arange(10), torch.arange(6)]))
    torch.testing.assert_close(both, encoded(model, torch.cat([first, second])))
    manifest = json.loads((tmp_path / "predict" / "manifest.json").read_text())
    assert [s["dataloader"] for s in manifest["shards"]] == [0, 1]  # a shard holds one dataloader's rows


def test_float16_halves_the_disk(tmp_path: Path) -> None:
    for kind, dtype in (("full", None), ("half", torch.float16)):
        extractor = FeatureExtractor("block:hidden", dirpath=tmp_path / kind, dtype=dtype)
        Trainer(callbacks=[extractor], **TRAINER).predict(Tokens(), loader(inputs(400)))
    sizes = [sum(p.stat().st_size for p in (tmp_path / kind / "predict").glob("*.safetensors"))
             for kind in ("full", "half")]
    assert 0.5 < sizes[1] / sizes[0] < 0.55  # 5 x 8 values a row, and one int64 id


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (root only: skipped elsewhere)."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_names_the_shard_and_leaves_whole_ones(small_disk: Path) -> None:
    with pytest.raises(OSError, match=r"could not write '.*/predict/rank0-shard000\d\d.safetensors': disk full"):
        extract(small_disk, n=400)
    folder = small_disk / "predict"
    assert not list(folder.glob(".*"))  # no temporary file left behind
    written = len(list(folder.glob("*.safetensors")))
    assert 5 < written < 50
    with pytest.raises(FileNotFoundError, match="has no manifest.json"):
        load_features(small_disk, "encoder.2")
    assert load_features(small_disk, "encoder.2", allow_partial=True).shape == (8 * written, 3)


def test_a_read_only_dirpath_fails_before_the_first_batch(small_disk: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    model = Encoder()
    trainer = Trainer(callbacks=[FeatureExtractor("encoder.2", dirpath=small_disk / "features")], **TRAINER)
    with pytest.raises(OSError, match=r"could not create the directory '.*/features': read-only file system"):
        trainer.predict(model, loader(inputs(8)))
    assert model.predicted == 0


def test_every_epoch_of_train_comes_back_each_id_in_saved_order(tmp_path: Path) -> None:
    x, keys = inputs(16), torch.arange(16)
    extractor = FeatureExtractor("encoder.2", dirpath=tmp_path, stages="train", sample_ids=lambda batch: batch[1])
    Trainer(callbacks=[extractor], max_epochs=3, **TRAINER).fit(
        Encoder(), DataLoader(TensorDataset(x, keys), batch_size=4, shuffle=True))
    features, ids = load_features(tmp_path, "encoder.2", stage="train", return_ids=True)
    assert torch.equal(ids, torch.arange(16).repeat_interleave(3))  # 48 rows: none merged
    saved = list(iter_features(tmp_path, "encoder.2", stage="train"))
    saved_rows, saved_ids = torch.cat([r for r, _ in saved]), torch.cat([i for _, i in saved])
    assert torch.equal(features, saved_rows[torch.sort(saved_ids, stable=True).indices])
    assert not torch.equal(features[0], features[1])  # id 0 in epochs 0 and 1: the model has learnt between
    mapped = load_features(tmp_path, "encoder.2", stage="train", mmap=True)
    assert torch.equal(mapped[:], features) and torch.equal(mapped.by_id([5]), features[15:16])


def test_only_the_padding_of_a_distributed_sampler_is_dropped() -> None:
    """Rank 1 repeats sample 0, as a DistributedSampler pads 5 samples to 6; only ``predict`` drops it."""
    def part(rank: int, ids: list[int]) -> tuple[Shard, torch.Tensor, torch.Tensor]:
        return Shard(Path(f"rank{rank}"), rank, 0, 0, {}, {}), torch.tensor(ids).float(), torch.tensor(ids)

    parts = [part(0, [0, 2, 4]), part(1, [1, 3, 0])]
    destinations, ids = _dataset_order(parts, "predict")
    assert torch.equal(ids, torch.arange(5))
    assert [d.tolist() for d in destinations] == [[0, 2, 4], [1, 3, -1]]
    destinations, ids = _dataset_order(parts, "validate")
    assert torch.equal(ids, torch.tensor([0, 0, 1, 2, 3, 4]))
    assert [d.tolist() for d in destinations] == [[0, 3, 5], [2, 4, 1]]
    same_rank = [part(0, [0, 1, 0])]  # a repeat on one rank is no padding: kept, even in predict
    assert torch.equal(_dataset_order(same_rank, "predict")[1], torch.tensor([0, 0, 1]))


def test_a_stage_not_of_the_four_is_refused_by_name(tmp_path: Path) -> None:
    extract(tmp_path, n=4)
    with pytest.raises(ValueError, match=r"`stage` must be one of \['train', 'validate', 'test', 'predict'\], got"
                                         r" 'fit': the rows `Trainer.fit` saves are under stage='train'"):
        load_features(tmp_path, "encoder.2", stage="fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must be one of .*, got 'Predict'"):
        iter_features(tmp_path, "encoder.2", stage="Predict")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`stage` must be one of .*list"):
        load_features(tmp_path, "encoder.2", stage=["predict"])  # type: ignore[arg-type]
