"""The measurement of the spike trigger on many healthy recipes: the recorder and the vectorised replay."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from lightning_hooks import SpikeTrigger
from lightning_hooks.measure.spikes import SpikeWindows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from spikes_models import Run, record, replay  # noqa: E402
from spikes_variants import zscores  # noqa: E402


def test_the_vectorised_replay_scores_each_step_as_the_package_judge_does_on_a_run_without_flags():
    gen = np.random.default_rng(0)
    steps = np.arange(400)
    loss = np.exp(-steps / 80 + 0.3 * gen.standard_normal(400)) + 1e-3  # falling, wandering by factors
    norm = np.exp(0.2 * gen.standard_normal(400))
    values = torch.tensor(np.stack([loss, norm], 1))
    windows, package = SpikeWindows(SpikeTrigger()), []
    for row in values:
        z, flags = windows.judge(row)
        assert not flags.any()  # no flag: the approximation (a flagged step's deviation kept) does not apply
        package.append(z.numpy())
        windows.remember(row)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the empty first windows
        fast = np.stack([zscores(loss), zscores(norm)], 1)
    assert np.abs(np.stack(package)[:64]).max() == 0 and np.abs(fast[:64]).max() == 0  # the warm-up
    np.testing.assert_allclose(fast, np.stack(package), rtol=1e-9, atol=1e-9)


def test_a_recorded_run_is_the_loss_and_gradient_norm_of_each_step_and_replays_through_the_windows():
    series = record(Run("mlp", 40))  # the zoo's MLP regression under Adam, as the zoo trains it
    assert series.shape == (40, 2) and series.isfinite().all() and (series > 0).all()
    assert series[-5:, 0].mean() < series[:5, 0].mean()  # it learns
    assert torch.equal(series, record(Run("mlp", 40)))  # seeded: the same series again
    z, flags, levels = replay(series, SpikeTrigger(window=16, warmup=8))
    assert z.shape == flags.shape == levels.shape == (40, 2)
    assert (z[:8] == 0).all() and (z[8:] != 0).any()  # judged from the 9th step on
