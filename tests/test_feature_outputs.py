"""What FeatureExtractor saves of an output: every tensor by name, a chosen few, pooled, cast, capped."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch import Tensor, nn

from lightning_hooks.callbacks.features import FeatureExtractor, load_features
from tests.test_features import TRAINER, Encoder, inputs, loader


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


def test_every_tensor_of_a_structured_output_is_saved_by_name(tmp_path: Path) -> None:
    model, x = Zoo(), inputs(7)
    extractor = FeatureExtractor(["lstm", "structured", "ragged"], dirpath=tmp_path)
    with pytest.warns(UserWarning) as record:
        Trainer(callbacks=[extractor], **TRAINER).predict(model, loader(x))
    messages = [str(w.message) for w in record]
    # h_n and c_n are (layers, N, H): their dim 0 is not the batch, so they cannot be rows.
    assert sum("'lstm:1.0' has 1 rows for a batch of 4 samples (its dim 0 is not the batch)" in m
               for m in messages) == 1
    assert any("'ragged' raised ValueError: its output 'ragged' has shape (3, 1)" in m for m in messages)
    with torch.no_grad():
        torch.testing.assert_close(load_features(tmp_path, "lstm:0"), model.lstm(x[:, None])[0])
    assert torch.equal(load_features(tmp_path, "structured:mask"), x > 0)
    assert torch.equal(load_features(tmp_path, "structured:value"), 2 * x)
    assert load_features(tmp_path, "ragged").shape == (4, 2)  # the first batch only
    with pytest.raises(FileNotFoundError, match=r"'lstm' .*: it returns a structured output, whose tensors are"
                                                 r" saved as \['lstm:0'\]; load one of those"):
        load_features(tmp_path, "lstm")


def test_module_key_entries_keep_only_the_outputs_they_name(tmp_path: Path) -> None:
    extractor = FeatureExtractor(["structured:val*", "lstm:0"], dirpath=tmp_path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        Trainer(callbacks=[extractor], **TRAINER).predict(Zoo(), loader(inputs(7)))
    assert not [w for w in record if "lstm:1" in str(w.message)]  # h_n and c_n were not asked for
    manifest = json.loads((tmp_path / "predict" / "manifest.json").read_text())
    assert sorted(manifest["outputs"]) == ["lstm:0", "structured:value"]


@dataclass
class EncoderOutput:
    hidden: Tensor  # (N, L, D)
    note: str


class TokenEncoder(nn.Module):
    """Five tokens of 8 features per sample, returned in a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Linear(4, 5 * 8)

    def forward(self, x: Tensor) -> EncoderOutput:
        return EncoderOutput(self.tokens(x).reshape(-1, 5, 8), "tokens")


class Tokens(Encoder):
    def __init__(self) -> None:
        super().__init__()
        self.block = TokenEncoder()

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.block(batch[0]).hidden


@pytest.mark.parametrize(
    ("reduce", "expected"),
    [
        ("mean", lambda h: h.mean(1)),
        ("max", lambda h: h.amax(1)),
        ("cls", lambda h: h[:, 0]),
        (lambda h: h[:, -2:].flatten(1), lambda h: h[:, -2:].flatten(1)),
    ],
)
def test_reduce_pools_tokens_on_the_fly(tmp_path: Path, reduce: object, expected: object) -> None:
    model, x = Tokens(), inputs(10)
    extractor = FeatureExtractor("block:hidden", dirpath=tmp_path, reduce=reduce)
    Trainer(callbacks=[extractor], **TRAINER).predict(model, loader(x))
    with torch.no_grad():
        tokens = model.block(x).hidden
    torch.testing.assert_close(load_features(tmp_path, "block:hidden"), expected(tokens))


def test_dtype_and_max_rows_shrink_what_is_saved(tmp_path: Path) -> None:
    model, x = Encoder(), inputs(30)
    extractor = FeatureExtractor("encoder.0", dirpath=tmp_path, dtype="float16", max_rows=13,
                                 flush_every_n_batches=2)
    Trainer(callbacks=[extractor], **TRAINER).predict(model, loader(x))
    features, ids = load_features(tmp_path, "encoder.0", return_ids=True)
    with torch.no_grad():
        expected = model.encoder[0](x[:13]).half()
    assert features.dtype == torch.float16 and torch.equal(features, expected)
    assert torch.equal(ids, torch.arange(13))  # the fourth batch cut at 13 rows, later batches not kept
