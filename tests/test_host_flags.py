"""Flags made on the host from the norms (one process, no running median) match those made on device."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hooks.distributed._rank_agreement import _flags, host_flags
from lightning_hooks.measure.anomalies import AnomalyDetector, gradient_figures

DETECTORS = [
    {}, {"norm_threshold": 5.0}, {"min_norm": 0.5}, {"norm_threshold": 5.0, "min_norm": 0.5},
    {"check_finite": False}, {"check_finite": False, "norm_threshold": 5.0},
    {"check_finite": False, "norm_threshold": 5.0, "min_norm": 0.5},
]
VALUES = [1.0, 100.0, 1e-3, math.nan, math.inf, -math.inf]


def _grads(seed: int) -> tuple[list[torch.Tensor], list[int]]:
    """Three groups of gradients, one of them poisoned or scaled by a value from ``VALUES``."""
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(4, 3, generator=generator) for _ in range(5)]
    value = VALUES[seed % len(VALUES)]
    if math.isfinite(value):
        grads[seed % 5].mul_(value)
    else:
        grads[seed % 5][0, 0] = value
    return grads, [2, 1, 2] if seed % 2 else [5]


@pytest.mark.parametrize("kwargs", DETECTORS)
def test_host_flags_are_the_device_flags(kwargs: dict) -> None:
    fired = set()
    for seed in range(24):
        grads, sizes = _grads(seed)
        figures = gradient_figures(grads, sizes, exact=False)
        assert figures.by_norm
        detector = AnomalyDetector(**kwargs)
        on_device = detector.flags(figures)
        n_cols = figures.group_norms.numel()
        expected = _flags(detector, on_device.reshape(-1).double().tolist(), n_cols)
        assert host_flags(detector, figures.group_norms.tolist()) == expected, (kwargs, seed)
        fired |= {name for name, on in expected.items() if on}
    assert fired or kwargs == {"check_finite": False}  # the cases raise flags, not only clean steps
