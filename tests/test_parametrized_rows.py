"""A parametrized module's parameter rows (``0.parametrizations.weight.original0``) are its module's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth
from lightning_hooks.core.selection import select_modules
from lightning_hooks.output._findings import layer_of, owner_of
from tests.helpers import TinyNet, loader, trainer


@pytest.mark.parametrize(("row", "layer"), [
    ("net.0.parametrizations.weight.original0", "net.0"),
    ("net.0.parametrizations.weight.original1", "net.0"),
    ("0.parametrizations.weight.original", "0"),  # spectral_norm's single original
    ("net.0.bias", "net.0"),
    ("net.0", "net.0"),  # a module's own row
    ("head", "head"),
])
def test_a_parameter_row_belongs_to_its_module_a_parametrized_ones_too(row, layer):
    assert layer_of(row, {"net.0": 0, "0": 0}) == layer
    assert owner_of(row) == (layer if row != "net.0" else "net")  # owner_of always takes a parameter's name


@pytest.mark.parametrize("granularity", ["parameter", "module"])
def test_a_weight_normed_layers_gradient_and_ratio_rows_are_judged_as_that_layer(tmp_path, granularity):
    torch.manual_seed(0)
    model = TinyNet()
    model.net[0] = weight_norm(model.net[0])
    health = LayerHealth(max_images=1)
    callbacks = [ActivationMonitor(), GradientMonitor(granularity=granularity, update_ratio=True), health]
    trainer(tmp_path, callbacks, logger=TensorBoardLogger(tmp_path), max_steps=6).fit(model, loader())
    judge = health._verdicts.judge
    rows = {(figure, row) for figure in ("norm", "ratio") for row in judge.tracks.get(figure, {})}
    assert rows, "the run judged no gradient or update-ratio row"
    layers = {judge.layer(figure, row) for figure, row in rows}
    assert not any(".parametrizations." in layer for layer in layers), layers
    assert layers <= {"net.0", "net.2"} and "net.0" in layers
    assert "other" not in {health._kind(row) for _, row in rows}  # the depth profile's kind is its module's


class _NaNFrom(TinyNet):
    """TinyNet whose loss is NaN from step 10 on: every gradient goes non-finite at once."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step >= 10 else loss


def test_when_every_gradient_goes_nan_the_real_last_module_is_named_not_a_parametrization(tmp_path):
    """The backward pass reaches the last module first: net.2, not the weight-normed net.0's rows."""
    torch.manual_seed(0)
    model = _NaNFrom()
    model.net[0] = weight_norm(model.net[0])
    health = LayerHealth(max_images=1)
    callbacks = [ActivationMonitor(), GradientMonitor(update_ratio=True), health]
    trainer(tmp_path, callbacks, logger=TensorBoardLogger(tmp_path), max_steps=14).fit(model, loader())
    episodes = health._verdicts.episodes
    first = min(e.first for e in episodes.values())
    assert first == 10
    assert {owner_of(row) for (_, row), e in episodes.items() if e.first == first} == {"net.2"}


@pytest.mark.parametrize("norm", [weight_norm, spectral_norm])
def test_a_glob_or_a_type_never_picks_a_module_inside_parametrizations(norm):
    """Their forward hooks would fire on every read of the weight, not once a forward."""
    class Square(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * w

    model = nn.Sequential(norm(nn.Linear(4, 4)), nn.ReLU(), nn.Linear(4, 2))
    torch.nn.utils.parametrize.register_parametrization(model[2], "weight", Square())
    assert [n for n, _ in select_modules(model, "0*")] == ["0"]
    assert [n for n, _ in select_modules(model, "*")] == ["0", "1", "2"]
    with pytest.raises(ValueError, match="matched no module") as raised:
        select_modules(model, "0.parametrizations*")
    assert "parametrizations" not in str(raised.value).split("Available modules:")[1]
    with pytest.raises(ValueError, match="holds no Square"):
        select_modules(model, Square)
    assert [n for n, _ in select_modules(model, [nn.Linear, "1"])] == ["0", "1", "2"]
