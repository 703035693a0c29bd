"""UpdateTransform: the update itself scaled, capped and clipped, for any optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hooks import GradientAnomalyStopping, UpdateTransform
from tests.update_helpers import BackboneHead, data, fit, largest_difference


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_scale_is_the_param_groups_lr_multiplied_over_50_steps(tmp_path, optimizer):
    scaled = fit(tmp_path, BackboneHead(optimizer), [UpdateTransform(scale={"backbone": 0.1})])
    reference = fit(tmp_path, BackboneHead(optimizer, backbone_lr=0.1))
    plain = fit(tmp_path, BackboneHead(optimizer))
    assert largest_difference(scaled, reference) < 2e-6  # float32 rounding over 50 steps
    assert largest_difference(plain, reference) > 1e-2  # and the lr does change the run


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_in_float64_the_match_is_to_rounding(tmp_path, optimizer):
    scaled = fit(tmp_path, BackboneHead(optimizer, dtype=torch.float64), [UpdateTransform(scale={"backbone.*": 0.1})])
    reference = fit(tmp_path, BackboneHead(optimizer, backbone_lr=0.1, dtype=torch.float64))
    assert largest_difference(scaled, reference) < 1e-12
