"""The measurement of the spike trigger on many healthy recipes: the recorder and the vectorised replay."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_hooks import SpikeTrigger
from lightning_hooks.measure.spikes import SpikeWindows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from spikes_models import Run, record, replay  # noqa: E402
from spikes_variants import above_scale, beyond_memory, zscores  # noqa: E402


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


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the first step has no level
def test_the_variants_scale_floor_weighs_a_rise_by_the_runs_highest_level_and_the_memory_by_its_largest_excursion():
    classifier = np.r_[np.full(20, 2.3), np.full(20, 1e-5), 3e-3]  # from 2.3 to 1e-5, then one hard sample: x300
    regression = np.r_[np.full(20, 1.0), np.full(20, 1e-4), 0.1]  # from 1.0 to 1e-4, then a corrupt batch: x1000
    assert not above_scale(classifier, 0.01)[-1]  # it rose by 0.1% of the run's highest level (2.3)
    assert above_scale(regression, 0.05)[-1]  # by 10% of its 1.0
    assert above_scale(classifier, 1e-3)[-1]
    wander = np.exp(0.1 * np.random.default_rng(0).standard_normal(120))
    wander[[70, 100]] *= [30, 20]  # a hard batch, then a smaller one, both after step 64
    beyond = beyond_memory(wander)
    assert beyond[70] and not beyond[100]
