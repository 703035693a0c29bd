"""The judge's warm-up: an output out by a step before its range can judge is named (docs/verdicts.md).

Hand-built figures (fast), as in ``tests/test_judge_rules.py``: four modules' std, logged every 2 steps, so the
rows' ranges judge from their 24th value (step 46) and the judge's warm-up of 48 steps.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

import pytest

from lightning_hooks.output._health_bands import Bands
from lightning_hooks.output._judge import Judge

CHAIN = ["stem", "attn", "mlp", "out"]


def named_at(move, seed: int, points: int) -> dict[int, list[str]]:
    """The layers named at each point (logged every 2 steps) where the four modules' std, steady to 0.3% on their
    own, are each times ``move(point, module)``."""
    rng, judge, named = random.Random(seed), Judge(Bands(), CHAIN), {}
    for i in range(points):
        levels = {row: (1 + d) * math.exp(rng.gauss(0, 0.003)) * move(i, row) for d, row in enumerate(CHAIN)}
        layers = [f.layer for f in judge.step({"level": levels}, 2 * i).named]
        if layers:
            named[i] = layers
    return named


@pytest.mark.parametrize("onset, factor", [(6, 20.0), (12, 20.0), (20, 8.0), (6, 0.01), (20, 0.03)])
def test_a_jump_before_the_ranges_judge_is_named_at_once_and_while_it_stays(onset, factor):
    """``mlp`` (and ``out``, after it) jump x``factor`` at a point of the warm-up (step 12-40), up or down (a layer's
    weights shrunk: a fall named past x1/25): ``mlp`` is named there and at every point after, first; ``out``, whose
    gain held, never."""
    def move(i, row):
        return factor if row in ("mlp", "out") and i >= onset else 1.0
    for seed in range(3):
        named = named_at(move, seed, 40)
        assert sorted(named) == list(range(onset, 40)), (seed, named)
        assert all(layers == ["mlp"] for layers in named.values()), (seed, named)


@pytest.mark.parametrize("rate", [1.5, 2.0])
def test_fast_early_learning_and_a_small_jump_in_the_warm_up_are_not_named(rate):
    """The prediction layer ``out`` grows x``rate`` a point over the first 10 points (an MLP's last Linear from a
    near-zero start), ``attn`` steps x4 at point 12 and ``stem`` falls x0.1 at point 14: in the warm-up none is a
    finding (x5 up is, x1/25 down)."""
    def move(i, row):
        if row == "out":
            return rate ** min(i, 10)
        if row == "stem":
            return 0.1 if i >= 14 else 1.0
        return 4.0 if row == "attn" and i >= 12 else 1.0
    for seed in range(3):
        assert named_at(move, seed, 24) == {}, seed


def test_every_module_out_by_a_step_in_the_warm_up_is_the_batch():
    """Every module x30 at point 12 (a bad batch in the warm-up): every layer at once, no layer named."""
    for seed in range(3):
        named = named_at(lambda i, row: 30.0 if i >= 12 else 1.0, seed, 16)
        assert named == dict.fromkeys(range(12, 16), ["(every layer)"]), (seed, named)


def named_with_pull(move, pull, chain: list[str], seed: int, points: int) -> dict[int, list[str]]:
    """As :func:`named_at`, over ``chain``, with the last module's pull ``pull(point, rng)`` logged at every point."""
    rng, judge, named = random.Random(seed), Judge(Bands(), chain), {}
    for i in range(points):
        levels = {row: (1 + d % 4) * math.exp(rng.gauss(0, 0.003)) * move(i, row) for d, row in enumerate(chain)}
        layers = [f.layer for f in judge.step({"level": levels, "pull": {chain[-1]: pull(i, rng)}}, 2 * i).named]
        if layers:
            named[i] = layers
    return named


def test_a_head_stepping_up_early_as_the_loss_asks_is_let_in():
    """The prediction layer ``out`` steps x8 at point 5 while the loss asks for more (pull < 0): excused, its range
    follows the step, so once the pull wanders about 0 (from point 30) it is not named."""
    def pull(i, rng):
        return -1.0 if i < 30 else rng.gauss(0, 0.1)
    for seed in range(3):
        named = named_with_pull(lambda i, row: 8.0 if row == "out" and i >= 5 else 1.0, pull, CHAIN, seed, 150)
        assert named == {}, (seed, named)


def test_a_whole_kind_stepping_up_early_is_let_in():
    """Every block's ``mlp`` steps x6 at point 8 (its kind growing together, in the warm-up): never named."""
    chain = ["stem"] + [f"blocks.{b}.{part}" for b in range(4) for part in ("attn", "mlp")] + ["out"]
    for seed in range(3):
        named = named_with_pull(lambda i, row: 6.0 if row.endswith("mlp") and i >= 8 else 1.0,
                                lambda i, rng: rng.gauss(0, 0.1), chain, seed, 100)
        assert named == {}, (seed, named)


def test_a_module_whose_gain_jumped_in_its_warm_up_past_its_early_peak_is_named_where_its_std_did_not():
    """The sweep's U-Net (``unseen43``, seed 3, logged every 5 steps; levels as LayerHealth got them, steps 0-80), its
    middle convolution's output x7.9 from step 57. At 59 (its 12th point, in its warm-up) its std went x5.6 in one
    point but only x4.67 above its early-learning peak (step 19), under ``WARM_JUMP``; its gain (its input steady)
    went x5.2 above its own: judged by its std alone before either noise was measured, it was never named."""
    data = json.loads(gzip.open(Path(__file__).parent / "data" / "unet_mid_jump_every5.json.gz", "rt").read())

    def named(steps: dict) -> dict[int, list[str]]:
        judge = Judge(Bands(), data["order"])
        return {int(step): [f.layer for f in judge.step(figures, int(step)).named]
                for step, figures in sorted(steps.items(), key=lambda item: int(item[0]))}

    recorded = named(data["steps"])
    assert recorded[59] == ["mid"] and not any(layers for step, layers in recorded.items() if step < 59), recorded
    # the network did not take it back: the middle and the modules after it stay where the step took them
    after = [row for row in data["order"] if data["order"].index(row) >= data["order"].index("mid")]
    kept = {step: {"level": {row: (data["steps"]["59"]["level"][row] if int(step) >= 59 and row in after else v)
                             for row, v in figures["level"].items()}} for step, figures in data["steps"].items()}
    stays = named(kept)
    assert all(stays[step] == ["mid"] for step in stays if step >= 59), stays
