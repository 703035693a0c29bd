"""The judge's rules, each on hand-built figures (fast): a step is not a ramp, an update ratio under its first,
a kind that grew as a whole, the prediction layer's pull, the rate limit of slow ramps, the last block of a depth
gradient, a row that learned along a curve, the first module ramping out, a slow lean against its peers from its
range, a gain that led its input's fall, and gradients gone to 0 together (docs/verdicts.md)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from torch import nn

from lightning_hooks.callbacks._judged_rows import judged_apart
from lightning_hooks.output._findings import SCALE_RATIO
from lightning_hooks.output._health_bands import Bands
from lightning_hooks.output._health_verdicts import judged_figure
from lightning_hooks.output._judge import Judge
from tests.test_judge_noise import recorded_names

CHAIN = ["stem", "attn", "mlp", "out"]


def first_named(judge: Judge, figures_at, points: int, every: int = 1) -> tuple[int, set[str], set[str]] | None:
    """The first point at which ``judge`` names a layer: the point, the layers named and the victims' rows."""
    for i in range(points):
        judged = judge.step(figures_at(i), i * every)
        if judged.named:
            return i, {f.layer for f in judged.named}, {f.row for f in judged.victims}
    return None


def chain_levels(move, seed: int):
    """Four modules' std, steady to 0.3% on their own, each times ``move(point, module)``."""
    rng = random.Random(seed)
    return lambda i: {"level": {row: (1 + d) * math.exp(rng.gauss(0, 0.003)) * move(i, row)
                                for d, row in enumerate(CHAIN)}}


@pytest.mark.parametrize("every, onset", [(1, 70), (10, 30)])  # logged every step, or every 10 (6 points past warm)
def test_a_step_is_named_itself_not_a_module_before_it_drifting_the_same_way(every, onset):
    """``attn`` drifts down 6% a point from 6 points before the onset (to x0.7, out of its own range but not yet
    a finding); at the onset ``mlp`` drops x0.6 in one logged point. A step is not a ramp: ``mlp`` is named."""
    def move(i, row):
        if row == "attn":
            return max(0.7, 0.94 ** max(0, i - onset + 6))
        return 0.6 if row in ("mlp", "out") and i >= onset else 1.0
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), chain_levels(move, seed), onset + 6, every)
        assert found is not None and found[:2] == (onset, {"mlp"}), (seed, found)


@pytest.mark.parametrize("every, onset", [(1, 70), (10, 30)])  # coarse: 0.6% a step logged every 10, few points
def test_a_ramp_upstream_is_named_over_the_module_after_it_that_crosses_its_range_first(every, onset):
    """``attn`` ramps 6% a point; ``mlp`` and ``out`` carry it amplified (their std as ``attn``'s to the power 1.3)
    and leave their range first, while ``attn`` leans out for several points: ``attn`` is named, they are victims
    (within 5 points: logged every 10, its lean is 20 steps old by its second point, a slow lean's, and its first
    point out waits for the next, ``_first_leans``)."""
    def move(i, row):
        k = max(0, i - onset)
        return {"attn": 1.06 ** k, "mlp": 1.06 ** (1.3 * k), "out": 1.06 ** (1.3 * k)}.get(row, 1.0)
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), chain_levels(move, seed), onset + 15, every)
        assert found is not None and found[1] == {"attn"} and onset < found[0] <= onset + 5, (seed, found)
        assert found[2] <= {"mlp", "out"}, (seed, found)


RATIO_ROWS = [f"net.{i}.weight" for i in range(6)]


def ratio_run(first: float, rise: float, seed: int, onset: int = 60) -> list[tuple[int, str, str, str]]:
    """Six rows' update ratios: ``first`` (``net.3``) or 1e-2 (the rest) at the first logged step, Adam's
    ``lr / rms(w)``, then 1e-4 with 5% noise; from ``onset`` ``net.3``'s times ``rise``. Each (point, layer,
    problem, figure) named."""
    rng, judge, named = random.Random(seed), Judge(Bands()), []
    for i in range(onset + 10):
        ratios = {row: 1e-2 if i == 0 else 1e-4 * math.exp(rng.gauss(0, 0.05)) for row in RATIO_ROWS}
        ratios["net.3.weight"] = first if i == 0 else ratios["net.3.weight"] * (rise if i >= onset else 1.0)
        named += [(i, f.layer, f.problem, f.figure) for f in judge.step({"ratio": ratios}).named]
    return named


def test_an_update_ratio_that_rises_above_its_range_but_not_above_its_first_is_not_too_fast():
    """``net.3``'s ratio climbs x50 its usual (to 5e-3, under 64x the step's median) but stays under its first
    logged ratio (1e-2: Adam's full step, as a unit coming alive takes it): not named."""
    for seed in range(3):
        assert ratio_run(1e-2, 50.0, seed) == [], seed


def test_an_update_ratio_that_rises_above_its_first_is_too_fast():
    """The same climb where its first logged ratio was 2e-3 (an LR warm-up's first step): above it, named."""
    for seed in range(3):
        assert ratio_run(2e-3, 50.0, seed)[0] == (60, "net.3", "too_fast", "ratio"), seed


def test_an_update_ratio_64_times_the_steps_median_is_named_at_once_even_under_its_first():
    """x80 the other rows' (8e-3), still under its first (1e-2): the 64x-the-median rule names it at the onset."""
    for seed in range(3):
        assert ratio_run(1e-2, 80.0, seed)[0] == (60, "net.3", "too_fast", "peers"), seed


BLOCKS = 4
NET = ["stem"] + [f"blocks.{b}.{k}" for b in range(BLOCKS) for k in ("conv", "act", "pool")]


def stacked_levels(gain, seed: int, batch: float, net: list[str] = NET):
    """A plain stack without normalisation: each module's std is the one's before it times its gain
    (``gain(point, module)``, 1% noise of its own), all times one batch factor (``batch`` noise, log)."""
    rng = random.Random(seed)

    def levels(i: int) -> dict[str, dict[str, float]]:
        factor, x, out = math.exp(rng.gauss(0, batch)), 1.0, {}
        for row in net:
            x *= gain(i, row) * math.exp(rng.gauss(0, 0.01))
            out[row] = factor * x
        return {"level": out}
    return levels


@pytest.mark.parametrize("after", [0.0, 0.01, 0.02])
def test_a_gain_whose_next_copy_moved_its_own_gain_alike_is_learning(after):
    """From point 60 ``blocks.2.conv``'s gain rises 1.5% a point (the batch moving every std, judged by gains).
    Alone, it is a fault: named. Where ``blocks.3.conv``'s own gain rises too, at least half as fast, it is the
    recipe (a healthy ViT at batch 4: two attention projections learning): a fault moves its own gain, not the
    gains after it (their inputs carry its move)."""
    def gain(i, row):
        rate = {"blocks.2.conv": 0.015, "blocks.3.conv": after}.get(row, 0.0)
        return math.exp(rate * max(0, i - 60))
    for seed in range(3):
        found = first_named(Judge(Bands(), NET), stacked_levels(gain, seed, 0.05), 100)
        if after:
            assert found is None or "blocks.2.conv" not in found[1], (seed, found)
        else:
            assert found is not None and found[1] == {"blocks.2.conv"}, (seed, found)


@pytest.mark.parametrize("batch", [0.0, 0.05])  # judged by their std, or by their gain (the batch moving all)
def test_a_kind_that_grew_as_a_whole_with_no_gain_leading_is_not_named(batch):
    """From point 60 every ``blocks.#.conv``'s gain rises x1.5 at once: every copy's std moves (compounding
    with depth, x1.5 to x5), every conv is out of its range together, and no copy's gain led: not named."""
    def gain(i, row):
        return 1.5 if row.endswith("conv") and i >= 60 else 1.0
    for seed in range(4):
        assert first_named(Judge(Bands(), NET), stacked_levels(gain, seed, batch), 120) is None, seed


@pytest.mark.parametrize("batch", [0.02, 0.05])
def test_a_kind_wide_step_judged_by_gain_is_not_named_when_the_gain_settles(batch):
    """Every conv's gain x1.3 at point 60 in a conv/act stack: judged by their gain (the batch moving all), whose
    move is the step's median, no finding. Their std's out-of-range finding, dropped for the gain, lets the std's
    range follow: 24 points on, the gain's noise jumping for a point as its history settles, nothing stale named."""
    net = ["stem"] + [f"blocks.{b}.{k}" for b in range(BLOCKS) for k in ("conv", "act")]

    def gain(i, row):
        return 1.3 if row.endswith("conv") and i >= 60 else 1.0
    for seed in range(4):
        assert first_named(Judge(Bands(), net), stacked_levels(gain, seed, batch, net), 120) is None, seed


@pytest.mark.parametrize("batch", [0.0, 0.05])
def test_one_copy_ramping_alone_with_its_gain_leading_is_named_before_the_copies_it_moved(batch):
    """``blocks.0.conv``'s gain ramps 6% a point from point 60: every copy after it moves as far (its victims),
    so every copy's std grew, but its gain led theirs: it is named, and no module after it first."""
    def gain(i, row):
        return 1.06 ** max(0, i - 60) if row == "blocks.0.conv" else 1.0
    for seed in range(4):
        found = first_named(Judge(Bands(), NET), stacked_levels(gain, seed, batch), 120)
        assert found is not None and found[1] == {"blocks.0.conv"} and 60 < found[0] <= 66, (seed, found)


HEAD = ["a", "b", "head"]


def steady_head(seed: int) -> Judge:
    """A judge that saw 60 logged steps of three modules steady (2% noise)."""
    rng, judge = random.Random(seed), Judge(Bands(), HEAD)
    for step in range(60):
        assert not judge.step({"level": {row: math.exp(rng.gauss(0, 0.02)) for row in HEAD}}, step).named
    return judge


def head_named(judge: Judge, head: float, pull: dict[str, float], step: int, b: float = 1.0) -> set[str]:
    return {f.row for f in judge.step({"level": {"a": 1.0, "b": b, "head": head}, "pull": pull}, step).named}


def test_the_prediction_layers_growth_is_not_named_while_the_loss_asks_for_it_and_is_once_it_does_not():
    """``head`` (the last module) x3: with its pull below 0 (the loss asks for a larger output) not named; above 0
    named; once named it stays named while out, whatever its pull."""
    for seed in range(3):
        judge = steady_head(seed)
        assert head_named(judge, 3.0, {"head": -0.2}, 60) == set(), seed
        assert head_named(judge, 3.0, {"head": 0.4}, 61) == {"head"}, seed
        assert head_named(judge, 3.0, {"head": -0.1}, 62) == {"head"}, seed


def test_a_recorded_head_growth_asked_for_in_the_warm_up_is_not_named_at_its_first_point_after():
    """The sweep's healthy GroupNorm CNN at LR 0.1 (``unseen29``; outputs' std and the head's pull as LayerHealth got
    them): its head grew x5 over steps 45-59 with the loss asking (pull -0.1 to -0.24), in the judge's warm-up, which
    let the growth in. At step 61, the first point past it, it is out with one batch's pull at +0.002: named
    ``blowup`` at steps 61-69 while no ask was remembered; the ask at the point before counts now."""
    assert not any(recorded_names("cnn_gn_lr01_healthy.json.gz").values())


@pytest.mark.parametrize("pull", [{}, {"b": -1.0}, {"head": 0.0}])  # not measured (or only for another module), 0
def test_the_prediction_layers_growth_without_a_pull_below_0_is_judged_as_any_layers(pull):
    """Where the pull of ``head`` is missing at the step, or 0, its blowup is named as without the rule."""
    for seed in range(3):
        assert head_named(steady_head(seed), 3.0, pull, 60) == {"head"}, seed


@pytest.mark.parametrize("pull, named", [({"head": 5.0}, "head"), ({"head": -5.0}, "b"), ({}, "b")])
def test_the_prediction_layer_that_overshot_far_past_the_modules_before_it_is_named_first(pull, named):
    """``head`` x30 and ``b`` before it x1.6 (under SGD the jump's gradient moved ``b``'s weights in the same step):
    with its pull above 0 ``head`` is named; below 0, or not measured, forward order names ``b``."""
    for seed in range(3):
        assert head_named(steady_head(seed), 30.0, pull, 60, b=1.6) == {named}, seed


GROWING = ["a", "b", "c", "head"]


def growing_head(rates: dict[str, float], seed: int, points: int = 20):
    """Four modules steady (2% noise) for 60 logged steps, then each of ``rates`` growing that much a point, the
    loss asking the head for more (its pull below 0). Yields each point's layers named."""
    rng, judge = random.Random(seed), Judge(Bands(), GROWING)
    for k in range(-60, points + 1):
        levels = {row: math.exp(rng.gauss(0, 0.02)) * rates.get(row, 1.0) ** max(0, k) for row in GROWING}
        named = {f.layer for f in judge.step({"level": levels, "pull": {"head": -0.1}}, 60 + k).named}
        if k > 0:
            yield named
        else:
            assert not named


def test_a_recorded_layer_rising_while_the_network_learns_its_targets_scale_is_not_named():
    """The sweep's healthy GELU MLP at half its LR (``unseen28``, Adam, regression, logged every 2 steps; its
    outputs' std and the head's pull as LayerHealth got them): the head's outputs x50 over steps 40-70, ``model.4``
    x1.5-1.8 with it, the head's input twice as far. ``model.4`` was named ``blowup`` at steps 57-103 (before the
    rule, as here with the rule off); now nothing is named."""
    assert not any(recorded_names("mlp_gelu_halflr_healthy.json.gz").values())


def test_a_recorded_ramp_while_the_head_learns_its_scale_is_named_at_its_first_point_out():
    """The sweep's RAdam MLP (``unseen15``) with ``model.4``'s outputs ramping 4% a step from step 100 while its
    head still grew x17 (its pull below 0 throughout): the head three times as far as the ramp, its input less far
    than the ramp. ``model.4`` is named at step 107, first, as before the rule."""
    named = recorded_names("mlp_radam_ramp_model4.json.gz")
    first = min(step for step, layers in named.items() if layers)
    assert first == 107 and named[first] == ["model.4"], named


@pytest.mark.parametrize("rates", [{"c": 1.06, "head": 1.15}, {"c": 1.05, "head": 1.25}])
def test_a_ramp_that_the_layers_after_it_carry_no_further_than_itself_is_named(rates):
    """``b`` ramps 6% a point and ``c`` after it (the head's input) grows about as far (its gain holds), the loss
    asking for more: ``b`` is named within a few points, as without the rule, though the head learns on, x2 and
    more, 2.4 and 3.8 times as far as ``b``: the head alone does not carry it."""
    for seed in range(3):
        named = list(growing_head({"b": 1.06, **rates}, seed, points=12))
        first = next(i for i, layers in enumerate(named) if layers)
        assert named[first] == {"b"} and first <= 8, (seed, named)


@pytest.mark.parametrize("rate, named", [(1.002, False), (1.003, False), (1.015, True)])
def test_a_ramp_too_slow_to_cross_the_least_change_within_min_points_is_followed_not_named(rate, named):
    """``mlp`` (and ``out`` after it) grows ``rate`` a step from point 60, logged every 2 steps, for 75 points.

    The rate limit of docs/verdicts.md ("Very slow ramps"): a ramp that does not get a least change
    (x1.17 for a gain) beyond its range within ``min_points`` (24) held points, 48 steps here, is a drift
    its level follows, as a healthy layer's late creep is; 1.5% a step is named, ``mlp`` and not ``out``.
    """
    every, onset = 2, 60

    def move(i, row):
        return rate ** (every * max(0, i - onset)) if row in ("mlp", "out") else 1.0
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), chain_levels(move, seed), onset + 75, every)
        assert (found is not None and found[1] == {"mlp"}) if named else found is None, (seed, found)


MIXER = [f"blocks.{b}.{k}" for b in range(BLOCKS) for k in ("ln", "mix")]
DEPTH_RATES = (0.0, 0.001, 0.004, 0.011)  # each block's ``mix`` grows faster than the block's before (a point)


def depth_gradient(seed: int, fault=lambda i: 1.0, rates=DEPTH_RATES):
    """A Mixer's depth gradient: each ``blocks.#.mix`` grows ``rates`` a point for 30 points from point 50 (by default
    block 3 x1.39, 2.75 times block 2's move: no copy after it to bound it), 2% noise, the LayerNorms before them
    steady; the last block's ``mix`` times ``fault(point)``."""
    rng = random.Random(seed)

    def levels(i: int) -> dict[str, dict[str, float]]:
        grown = min(max(i - 50, 0), 30)
        out = {f"blocks.{b}.ln": math.exp(rng.gauss(0, 0.002)) for b in range(BLOCKS)}
        out.update({f"blocks.{b}.mix": math.exp(rates[b] * grown + rng.gauss(0, 0.02)) for b in range(BLOCKS)})
        out["blocks.3.mix"] *= fault(i)
        return {"level": out}
    return levels


def test_the_last_block_of_a_depth_gradient_is_learning_not_a_fault():
    """``blocks.3.mix`` moves 2.75 times as far as ``blocks.2.mix``, which moved the same way: not named."""
    for seed in range(4):
        assert first_named(Judge(Bands(), MIXER), depth_gradient(seed), 140) is None, seed


@pytest.mark.parametrize("onset, rates", [(75, (0.0, 0.002, 0.012, 0.012)), (110, DEPTH_RATES)])
def test_a_jump_in_the_last_block_of_a_depth_gradient_is_named_at_once(onset, rates):
    """x1.5 in one point, during a gradient's learning (block 3 moving as block 2, the jump within 3 times
    their move: a step is its own, not learning) and after it; named while out, not excused from the point
    after the jump on (at least 20 of the 24 points from it)."""
    for seed in range(4):
        jump, judge = depth_gradient(seed, lambda i: 1.5 if i >= onset else 1.0, rates), Judge(Bands(), MIXER)
        assert first_named(judge, jump, onset + 5)[:2] == (onset, {"blocks.3.mix"}), seed
        later = [i for i in range(onset + 1, onset + 24)
                 if "blocks.3.mix" in {f.layer for f in judge.step(jump(i), i).named}]
        assert len(later) >= 19, (seed, later)  # with the point of the jump, 20 of 24


def test_a_ramp_in_the_last_block_after_the_gradients_learning_is_named_within_a_few_points():
    for seed in range(4):
        ramp = depth_gradient(seed, lambda i: 1.05 ** max(0, i - 110))
        found = first_named(Judge(Bands(), MIXER), ramp, 130)
        assert found is not None and found[1] == {"blocks.3.mix"} and 110 < found[0] <= 118, (seed, found)


@pytest.mark.parametrize("rise", [1.02, 1.03])
def test_a_ramp_in_the_last_block_during_its_predecessors_learning_is_named_not_learned(rise):
    """Blocks 2 and 3 learn alike (1.2% a point, points 50-80); block 3 ramps from point 60 on top: excused while
    block 2 moves, its range held, not learned: named once it goes on past block 2's move, before point 90."""
    for seed in range(4):
        ramp = depth_gradient(seed, lambda i: rise ** max(0, i - 60), (0.0, 0.002, 0.012, 0.012))
        found = first_named(Judge(Bands(), MIXER), ramp, 90)
        assert found is not None and found[1] == {"blocks.3.mix"}, (seed, found)


def curve_then_ramp(onset: int, seed: int):
    """``mlp``'s std learns along a curve (x40 over the first 30 points, then flattening; 1% noise), the others
    steady; from ``onset`` ``mlp`` (and ``out`` after it) ramps 20% a point (4% a step logged every 5)."""
    rng = random.Random(seed)

    def levels(i: int) -> dict[str, dict[str, float]]:
        curve = math.exp(3.7 * (1 - math.exp(-i / 10))) * 1.2 ** max(0, i - onset)
        return {"level": {row: (1 + d) * math.exp(rng.gauss(0, 0.01)) * (curve if row in ("mlp", "out") else 1.0)
                          for d, row in enumerate(CHAIN)}}
    return levels


def test_a_ramp_on_a_row_that_learned_along_a_curve_is_named_its_noise_from_its_moves():
    """A window holding the curve strays 20-30% from any straight line through it, though each point is within 1%
    of the one before: judged by the moves' spread, the ramp from point 30 is named within 6 points (x3; judged
    by the line's, 11 or more)."""
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), curve_then_ramp(30, seed), 60, every=5)
        assert found is not None and found[1] == {"mlp"} and 30 < found[0] <= 36, (seed, found)


def test_a_row_still_learning_along_a_curve_is_not_named():
    """The same curve without a ramp: its moves are its learning, not a finding, at any point."""
    for seed in range(4):
        assert first_named(Judge(Bands(), CHAIN), curve_then_ramp(10 ** 6, seed), 120, every=5) is None, seed


@pytest.mark.parametrize("rate", [1.08, 1.15])
def test_the_first_module_ramping_out_is_named_itself_not_the_batch(rate):
    """``stem`` (the first module, its input the batch) ramps 8% or 15% a point from point 60, every module after
    it carried along: no step, so not the batch; ``stem`` is named, the modules after it its victims."""
    def move(i, row):
        return rate ** max(0, i - 60)
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), chain_levels(move, seed), 90)
        assert found is not None and found[1] == {"stem"} and 60 < found[0] <= 66, (seed, found)


def test_the_first_module_and_every_module_after_it_out_by_a_step_is_the_batch():
    """Every module x5 in one point at point 60 (the batch out of range): every layer at once, named at once."""
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), chain_levels(lambda i, row: 5.0 if i >= 60 else 1.0, seed), 70)
        assert found is not None and found[:2] == (60, {"(every layer)"}), (seed, found)


LEAN = ["emb", "h.0.a", "h.0.m", "h.1.a", "h.1.m", "h.2.a", "h.2.m", "out"]


def slow_lean(seed: int, peers_rate: float):
    """``h.2.a`` leans out x1.17 at point 50 (under a finding), 23 points on a further x1.13 (past it); the copies
    of its kind before it (``h.0.a``, ``h.1.a``) climb ``peers_rate`` (log) a point all along, in their own range."""
    rng = random.Random(seed)

    def figures(i: int) -> dict[str, dict[str, float]]:
        move = {"h.0.a": peers_rate * i, "h.1.a": peers_rate * i,
                "h.2.a": 0.16 * (i >= 50) + 0.12 * (i >= 73)}
        return {"level": {row: (1 + d) * math.exp(move.get(row, 0.0) + rng.gauss(0, 0.005))
                          for d, row in enumerate(LEAN)}}
    return figures


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_slow_lean_out_of_a_range_older_than_the_peers_window_is_compared_with_the_peers_from_its_range(seed):
    """Its move within the peers' window (32 points) is under the margin, its move from its range (held since 23
    points) past it: measured from its range, its peers before it moved as far (x1.2 in the window), learning.
    Peers steady, it is named a point or two after its step (a step on a slow lean, within twice the least change,
    waits a point where the lean's pace before it was a creep: one batch's, or a step that stays; and a first point
    out within twice it on a lean 12 steps old waits a point, ``_first_leans``)."""
    assert first_named(Judge(Bands(), LEAN), slow_lean(seed, 0.008), 110, 2) is None
    found = first_named(Judge(Bands(), LEAN), slow_lean(seed, 0.0), 110, 2)  # peers steady: named
    assert found is not None and found[1] == {"h.2.a"} and found[0] in (73, 74, 75), found


PULLED = ["stem", "enc", "mid", "dec", "out"]


@pytest.mark.parametrize("rise, fall, lag", [(1.1, 0.85, 1), (1.06, 0.9, 2)])
def test_a_gain_that_led_its_inputs_fall_is_named_though_its_std_held(rise, fall, lag):
    """``dec``'s gain ramps ``rise`` a point from point 60; ``lag`` points later ``mid`` before it shrinks ``fall`` a
    point (a loss pulling ``dec``'s outputs back through the modules before it), so ``dec``'s std moves less than
    half its gain. Its gain led: ``dec`` is named, not ``mid`` whose std fell after it."""
    def gain(i, row):
        k = max(0, i - 60)
        return {"dec": rise ** k, "mid": fall ** max(0, k - lag)}.get(row, 1.0)
    for seed in range(4):
        found = first_named(Judge(Bands(), PULLED), stacked_levels(gain, seed, 0.05, PULLED), 90)
        assert found is not None and found[1] == {"dec"} and 60 < found[0] <= 65, (seed, found)


@pytest.mark.parametrize("rise, fall, lag", [(1.1, 0.85, 1), (1.06, 0.9, 2)])
def test_a_gain_that_led_its_inputs_fall_is_named_in_a_module_without_weights_of_its_own(rise, fall, lag):
    """As above, with every other module's update ratio logged and none of ``dec``'s (an activation a fault's hook
    scales): a gain that led upward is its own whatever the module (only a weightless module's gain falling as its std
    rose is its input's distribution's, ``_level_agrees``). ``dec`` is named, not ``mid``."""
    def gain(i, row):
        k = max(0, i - 60)
        return {"dec": rise ** k, "mid": fall ** max(0, k - lag)}.get(row, 1.0)
    def with_ratios(seed: int):
        levels, rng = stacked_levels(gain, seed, 0.05, PULLED), random.Random(seed)

        def figures(i: int) -> dict[str, dict[str, float]]:
            ratios = {f"{row}.weight": 1e-3 * math.exp(rng.gauss(0, 0.05)) for row in PULLED if row != "dec"}
            return {**levels(i), "ratio": ratios}
        return figures
    for seed in range(4):
        found = first_named(Judge(Bands(), PULLED), with_ratios(seed), 90)
        assert found is not None and found[1] == {"dec"} and 60 < found[0] <= 65, (seed, found)


def test_a_gain_moved_by_its_inputs_step_is_not_named_for_it():
    """``mid``'s gain drops x0.8 at point 60 and ``dec``'s rises x1.15 (a saturating layer passing on less of its
    input's fall): ``dec``'s std moved the other way, its input from the same point: ``mid`` is named, not ``dec``."""
    def gain(i, row):
        return {"mid": 0.8, "dec": 1.15}.get(row, 1.0) if i >= 60 else 1.0
    for seed in range(4):
        found = first_named(Judge(Bands(), PULLED), stacked_levels(gain, seed, 0.05, PULLED), 90)
        assert found is None or "dec" not in found[1], (seed, found)


def zeroed_gradients(seed: int, zero: set[str]):
    """The chain's outputs steady; its parameters' gradient norms steady (3% noise), those in ``zero`` exactly 0 from
    point 60 (a zeroed output takes the gradients of its own weights and of what feeds only it, before it, with it)."""
    rng = random.Random(seed)
    levels = chain_levels(lambda i, row: 1.0, seed)

    def figures(i: int) -> dict[str, dict[str, float]]:
        norms = {f"{row}.weight": 0.0 if i >= 60 and row in zero else (1 + d) * math.exp(rng.gauss(0, 0.03))
                 for d, row in enumerate(CHAIN)}
        return {**levels(i), "norm": norms}
    return figures


def test_gradients_gone_to_0_together_name_the_last_in_forward_order():
    """``attn``'s and ``mlp``'s weight gradients are exactly 0 from point 60, both moved as far (to -inf): the last
    in forward order, the first the backward pass reached, is named (``mlp``), ``attn`` its victim."""
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), zeroed_gradients(seed, {"attn", "mlp"}), 70)
        assert found is not None and found[:2] == (60, {"mlp"}) and found[2] == {"attn.weight"}, (seed, found)


def product_levels(rate: float, seed: int):
    """``attn`` (steady to 0.3%) ramps ``rate`` a point from point 70; ``mlp`` multiplies two branches of it (a gate
    times its value, Mamba's ``y * silu(z)``): it moves as ``attn``'s square, noisier (3%), and ``out`` with it."""
    rng = random.Random(seed)

    def figures(i: int) -> dict[str, dict[str, float]]:
        k = max(0, i - 70)
        move = {"attn": (rate ** k, 0.003), "mlp": (rate ** (2.5 * k), 0.03), "out": (rate ** (2.5 * k), 0.03)}
        return {"level": {row: (1 + d) * move.get(row, (1.0, 0.003))[0] * math.exp(rng.gauss(0, move.get(
            row, (1.0, 0.003))[1])) for d, row in enumerate(CHAIN)}}
    return figures


@pytest.mark.parametrize("rate", [1.08, 1.1])  # logged every 2 steps: ramps of 4-5% a step
def test_a_ramp_into_a_product_of_two_branches_is_named_over_the_product(rate):
    """The product (``mlp``) leaves its range first, ``attn`` leaning out a little under half as far beyond its
    range (its square's move less the product's noise): ``attn`` is named, ``mlp`` and ``out`` are its victims."""
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), product_levels(rate, seed), 100)
        assert found is not None and found[1] == {"attn"} and 70 < found[0] <= 80, (seed, found)


@pytest.mark.parametrize("share", [0.8, 0.9])
def test_a_module_before_leaning_out_points_after_the_first_one_out_is_its_victim(share):
    """``mlp`` (and ``out``) ramp 8% a point from point 70; ``attn`` before it follows ``share`` as fast from 2 points
    later (a victim leaning out after the culprit, under SGD): ``mlp`` is named, not ``attn`` (a third as far is
    enough only for a module out with the first one or one point after)."""
    def figures(seed):
        rng = random.Random(seed)
        moves = {"attn": lambda i: 1.08 ** (share * max(0, i - 72)), "mlp": lambda i: 1.08 ** max(0, i - 70)}
        moves["out"] = moves["mlp"]
        return lambda i: {"level": {row: (1 + d) * moves.get(row, lambda i: 1.0)(i) * math.exp(rng.gauss(0, 0.003))
                                    for d, row in enumerate(CHAIN)}}
    for seed in range(10):
        found = first_named(Judge(Bands(), CHAIN), figures(seed), 100)
        assert found is not None and found[1] == {"mlp"} and 70 < found[0] <= 76, (seed, found)


@pytest.mark.parametrize("other", [0.0, 30.0])  # gone to 0, or x30 (at most 30 times its norm): NaN moved further
def test_a_non_finite_gradient_ties_with_gradients_gone_to_0_and_beats_a_finite_move(other):
    """From point 60 ``mlp``'s weight gradient is NaN and ``attn``'s ``other`` times its norm: the NaN counts as
    moved without bound, so the last in forward order out so far (``mlp``) is named first."""
    def figures(seed):
        base = zeroed_gradients(seed, set())

        def at(i: int) -> dict[str, dict[str, float]]:
            found = base(i)
            if i >= 60:
                found["norm"]["mlp.weight"], found["norm"]["attn.weight"] = math.nan, other * 2.0
            return found
        return at
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), figures(seed), 70)
        assert found is not None and found[:2] == (60, {"mlp"}), (seed, found)


def scale_run(rise: float, seed: int, onset: int = 60, every: float = 1.0,
              odd_without: bool = False) -> list[tuple[int, str, str, str]]:
    """Six weights' update ratios at 1e-4 (5% noise) and a norm's scale's at 1e-3 (30% noise), all on a cosine
    LR; from ``onset`` the scale's times ``rise`` (its param group's LR), every row's times ``every`` (the whole
    schedule's); with ``odd_without``, the odd points hold the weights' ratios only (the scale logged every
    other point). Each (point, layer, problem, figure) named."""
    rng, judge, named = random.Random(seed), Judge(Bands()), []
    for i in range(onset + 10):
        lr = 0.5 * (1 + math.cos(math.pi * i / (2 * onset))) * (every if i >= onset else 1.0)
        ratios = {row: lr * 1e-4 * math.exp(rng.gauss(0, 0.05)) for row in RATIO_ROWS}
        scale = lr * 1e-3 * math.exp(rng.gauss(0, 0.3)) * (rise if i >= onset else 1.0)
        figures = {"ratio": ratios, SCALE_RATIO: {"net.norm.weight": scale}}
        if odd_without and i % 2:
            del figures[SCALE_RATIO]
        named += [(i, f.layer, f.problem, f.figure) for f in judge.step(figures, i).named]
    return named


def test_a_norms_scale_whose_learning_rate_went_up_x100_is_named_too_fast_at_once():
    """A norm's scale is judged by its update ratio alone (its outputs move a few %): x100 is named at the onset."""
    for seed in range(4):
        assert scale_run(100.0, seed)[:1] == [(60, "net.norm", "too_fast", "ratio")], seed


def test_a_norms_scale_named_stays_named_while_out_near_the_threshold():
    """x20 (its deviation from its range about x10, either side of ``SCALE_JUMP``): named at the onset and at every
    point after, one episode, not one per point past the threshold."""
    for seed in range(4):
        points = [i for i, *_ in scale_run(20.0, seed)]
        assert points and points[0] <= 61 and points == list(range(points[0], 70)), seed


def test_a_norms_scale_named_stays_named_across_points_that_do_not_hold_it():
    for seed in range(4):
        points = [i for i, *_ in scale_run(20.0, seed, odd_without=True)]
        assert points and points[0] <= 64 and points == list(range(points[0], 70, 2)), seed


def test_a_norms_scale_moving_with_every_rows_ratio_is_not_named():
    """The whole schedule x20 at once (every row's ratio with it): the common move, taken out, not the scale's."""
    for seed in range(4):
        assert [f for f in scale_run(1.0, seed, every=20.0) if f[1] == "net.norm"] == [], seed


def test_a_norms_scale_ratio_up_x5_is_not_named_where_a_weights_would_be():
    """A few entries' ratio moves far more than a weight's: a scale is named only ``SCALE_JUMP`` (x10) beyond its
    range; x5 that stays (over 30% noise) is not, though ``ratio_factor`` (x4) would name a weight's."""
    for seed in range(4):
        assert scale_run(5.0, seed) == [], seed


@pytest.mark.parametrize("figure, row, value, judged", [
    ("ratio", "net.norm.weight", 1e-3, SCALE_RATIO), ("ratio", "net.0.bias", 1e-3, None),
    ("ratio", "net.act.weight", 1e-3, None), ("norm", "net.norm.weight", 1e-3, None),
    ("ratio", "net.0.bias", math.nan, "ratio"), ("ratio", "net.0.weight", 1e-3, "ratio"),
    ("level", "net.norm", 1.0, "level")])
def test_a_1d_rows_ratio_is_judged_apart_for_a_norms_scale_left_out_for_a_bias_and_a_nan_is_a_nan(
        figure, row, value, judged):
    """LayerHealth's and the tab's rule (``judged_figure``): the 1-D rows are a bias, a PReLU's slope and a norm's
    scale (``_judged_rows.py``)."""
    assert judged_figure(figure, row, value, {"net.0.bias", "net.act.weight"}, {"net.norm.weight"}) == judged


def test_the_rows_judged_apart_are_the_norms_scales_by_the_names_the_monitors_write():
    """A LayerNorm's and an RMSNorm's weight are scales; a bias and a PReLU's 1-D slope are not judged; a compiled
    submodule's names lose their ``_orig_mod`` as the monitors' rows do."""
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.PReLU(8), nn.Linear(8, 8), nn.RMSNorm(8))
    model[3] = torch.compile(model[3])
    unjudged, scales = judged_apart(model)
    assert scales == {"1.weight", "4.weight"}
    assert unjudged == {"0.bias", "1.bias", "2.weight", "3.bias"}


def spike_run(spike: dict[int, float], seed: int, with_ratio: bool = False,
              level: dict[int, float] | None = None) -> list[tuple[int, str, str]]:
    """Six weights' gradient norms at 0.05 (20% noise); ``net.2``'s times ``spike[point]`` where given (every
    other row's x2 there too, the batch's), and with ``with_ratio`` its update ratio as far; with ``level``,
    ``net.0``'s and ``net.1``'s output std (1% noise), ``net.1``'s times ``level[point]``. Each (point, layer,
    problem) named, and each (point, row, "victim") counted as one."""
    rng, judge, named = random.Random(seed), Judge(Bands()), []
    for i in range(120):
        jump = spike.get(i, 1.0)
        norms = {row: 0.05 * math.exp(rng.gauss(0, 0.2)) * (2.0 if jump > 1 else 1.0) for row in RATIO_ROWS}
        norms["net.2.weight"] *= jump / (2.0 if jump > 1 else 1.0)
        ratios = {row: 1e-4 * math.exp(rng.gauss(0, 0.05)) for row in RATIO_ROWS}
        ratios["net.2.weight"] *= jump if with_ratio else 1.0
        figures = {"norm": norms, "ratio": ratios}
        if level is not None:
            figures["level"] = {"net.0": math.exp(rng.gauss(0, 0.01)),
                                "net.1": math.exp(rng.gauss(0, 0.01)) * level.get(i, 1.0)}
        judged = judge.step(figures, i)
        named += [(i, f.layer, f.problem) for f in judged.named] + [(i, f.row, "victim") for f in judged.victims]
    return named


def test_one_layers_gradient_out_for_one_step_alone_is_not_named():
    """A batch's gradient concentrated in one layer for one step (x20 while the rest go x2; a healthy Qwen2's keys
    at 3x its LR: x14): not the layer's fault."""
    for seed in range(4):
        assert spike_run({100: 20.0}, seed) == [], seed


def test_one_layers_gradient_out_two_steps_running_is_named_at_the_second():
    for seed in range(4):
        assert spike_run({100: 20.0, 101: 20.0}, seed)[:1] == [(101, "net.2", "exploding")], seed


def test_a_gradient_out_one_step_beside_a_named_layer_is_its_victim_not_named_after_it():
    """``net.1``'s outputs x10 at one point with ``net.2``'s gradient x20 at it and the next: ``net.1`` is named, the
    gradient counted as its victim from the first point, and not named as it recovers."""
    for seed in range(3):
        named = spike_run({100: 20.0, 101: 20.0}, seed, level={100: 10.0})
        assert (100, "net.1", "blowup") in named and (100, "net.2.weight", "victim") in named, (seed, named)
        assert not [f for f in named if f[1] == "net.2"], (seed, named)


def test_one_layers_gradient_out_with_its_update_ratio_is_named_at_once():
    for seed in range(4):
        named = spike_run({100: 20.0}, seed, with_ratio=True)
        assert {(i, problem) for i, layer, problem in named if layer == "net.2" and i == named[0][0]} == {
            (100, "exploding"), (100, "too_fast")}, seed


def coarse_levels(rate: float, onset: int, seed: int):
    """Logged every 20 steps: four modules learning along a curve (each point 15% of the way closer to their level,
    from 0.3x) with 3% noise; from ``onset`` ``mlp`` and ``out`` times ``rate`` a point."""
    rng = random.Random(seed)

    def levels(i: int) -> dict[str, dict[str, float]]:
        learned = 1 - 0.7 * 0.85 ** i
        return {"level": {row: (1 + d) * learned * math.exp(rng.gauss(0, 0.03))
                          * (rate ** (i - onset + 1) if row in ("mlp", "out") and i >= onset else 1.0)
                          for d, row in enumerate(CHAIN)}}
    return levels


def test_logged_every_20_steps_a_ramp_from_the_tenth_point_is_named_within_two_points():
    """A ramp x2.2 a point (4% a step) from point 10 (step 200): the rows' ranges judge from their 8th value once
    they span 120 steps, not from their 24th (step 460), by which the ramp would be their own history."""
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), coarse_levels(2.2, 10, seed), 30, every=20)
        assert found is not None and found[1] == {"mlp"} and 10 <= found[0] <= 11, (seed, found)


def test_logged_every_20_steps_a_row_learning_along_a_curve_is_not_named():
    for seed in range(4):
        assert first_named(Judge(Bands(), CHAIN), coarse_levels(1.0, 10 ** 6, seed), 40, every=20) is None, seed


@pytest.mark.parametrize("attn, mlp, named", [(1.4, 20.0, "mlp"), (0.6, 20.0, "mlp"), (1.4, 2.0, "attn")])
def test_a_step_far_past_the_moves_before_it_at_the_same_point_is_named_over_them(attn, mlp, named):
    """At point 60 ``attn`` moves x1.4 (or x0.6) and ``mlp`` x20 (``out`` carried along), all from the same point:
    logged coarsely, the layers before a step learn in reaction before the next point. A step five times as far
    (log) as every move before it is named; x2 after a x1.4 is not that far: forward order names ``attn``."""
    def move(i, row):
        return {"attn": attn, "mlp": mlp, "out": mlp}.get(row, 1.0) if i >= 60 else 1.0
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), chain_levels(move, seed), 70)
        assert found is not None and found[:2] == (60, {named}), (seed, found)



def thawed_run(onset: int, lift: float, seed: int, frozen: bool):
    """The chain's levels and its layers' gradient norms; from ``onset`` ``attn``'s std lifted up to ``lift`` over 5
    points. ``frozen``: ``attn``'s gradient rows absent (its parameters frozen) until ``onset``, its first steps of
    training."""
    rng = random.Random(seed)

    def figures(i: int) -> dict[str, dict[str, float]]:
        grow = lift ** min(1.0, max(0, i - onset) / 5)
        levels = {row: (1 + d) * math.exp(rng.gauss(0, 0.01)) * (grow if row == "attn" else 1.0)
                  for d, row in enumerate(CHAIN)}
        norms = {f"{row}.weight": math.exp(rng.gauss(0, 0.05)) for row in CHAIN
                 if row != "attn" or not frozen or i >= onset}
        return {"level": levels, "norm": norms}
    return figures


@pytest.mark.parametrize("frozen", [True, False])
def test_a_layer_thawed_mid_run_is_in_a_warm_up_of_its_own(frozen):
    """``attn`` x1.5 over 5 points from point 60 and held there. Frozen until then (no gradient rows), it is a
    fine-tuning run's thawed layer learning: not named. The same move on a layer that trained all along is."""
    for seed in range(4):
        found = first_named(Judge(Bands(), CHAIN), thawed_run(60, 1.5, seed, frozen), 120)
        if frozen:
            assert found is None, (seed, found)
        else:
            assert found is not None and found[1] == {"attn"} and found[0] <= 66, (seed, found)


def test_a_ramp_in_a_thawed_layer_after_its_warm_up_is_named():
    """Thawed at point 20 (no move), ``attn`` ramps 8% a point from point 100, past its own warm-up: named."""
    for seed in range(4):
        ramp = thawed_run(20, 1.0, seed, True)

        def figures(i: int, ramp=ramp):
            out = ramp(i)
            out["level"]["attn"] *= 1.08 ** max(0, i - 100)
            return out
        found = first_named(Judge(Bands(), CHAIN), figures, 130)
        assert found is not None and found[1] == {"attn"} and 100 < found[0] <= 106, (seed, found)


ATTENTION = ["emb", "attn.query", "attn.key", "attn.value", "attn.dense", "out"]


def attention_levels(query, key, seed: int):
    """An attention's modules steady to 1% (no copies of them: one layer, as ALBERT's shared one); ``query(i)`` and
    ``key(i)`` times the query's and the key's std."""
    rng = random.Random(seed)
    return lambda i: {"level": {row: (1 + d) * math.exp(rng.gauss(0, 0.01))
                                * {"attn.query": query(i), "attn.key": key(i)}.get(row, 1.0)
                                for d, row in enumerate(ATTENTION)}}


@pytest.mark.parametrize("query, key, named", [
    (lambda i: 1.015 ** min(90, max(0, i - 60)), lambda i: 1.015 ** min(90, max(0, i - 60)), None),  # both, x3.8
    (lambda i: 1.04 ** max(0, i - 60), lambda i: 1.0, "attn.query"),  # a fault in the queries alone
    (lambda i: 1.04 ** max(0, i - 60), lambda i: 1.005 ** max(0, i - 60), "attn.query")])  # far past the keys
def test_queries_and_keys_growing_together_are_attention_sharpening_one_alone_is_named(query, key, named):
    """With no copies to learn beside, the query and key projections of one attention growing together (their
    product is the logits) is learning; the queries growing alone, or far past the keys, is named."""
    for seed in range(4):
        found = first_named(Judge(Bands(), ATTENTION), attention_levels(query, key, seed), 160)
        assert (found and found[1]) == ({named} if named else None), (seed, found)


def test_the_layers_inside_a_block_thawed_as_a_whole_are_in_its_warm_up():
    """Gradient rows by block (``blk``) absent until point 60, then ``blk.attn``'s std x1.5 over 5 points: the
    block's layers started training with it, not named."""
    rows, rng = ["emb", "blk.attn", "blk.mlp", "out"], random.Random(0)
    for seed in range(4):
        rng.seed(seed)

        def figures(i: int) -> dict[str, dict[str, float]]:
            lift = 1.5 ** min(1.0, max(0, i - 60) / 5)
            levels = {row: (1 + d) * math.exp(rng.gauss(0, 0.01)) * (lift if row == "blk.attn" else 1.0)
                      for d, row in enumerate(rows)}
            norms = {row: math.exp(rng.gauss(0, 0.05)) for row in ("emb", "out", *(("blk",) if i >= 60 else ()))}
            return {"level": levels, "norm": norms}
        assert first_named(Judge(Bands(), rows), figures, 120) is None, seed


@pytest.mark.parametrize("history", [False, True])
def test_no_thaw_where_gradients_come_in_late_for_every_layer_or_a_layer_had_no_outputs_before(history):
    """Gradient rows for every layer from point 30 only (a monitor on its own cadence, a resumed judge): the first
    step holding any is where they start, nothing is thawed, and ``attn``'s x1.5 at point 60 is named. Without
    outputs before (``history`` False: an expert first routed at 60), it is new, not thawed: judged as new."""
    for seed in range(4):
        thawed = thawed_run(60, 1.5, seed, frozen=not history)

        def figures(i: int, thawed=thawed) -> dict[str, dict[str, float]]:
            out = thawed(i)
            out["norm"] = out["norm"] if i >= 30 else {}
            if not history and i < 60:
                del out["level"]["attn"]
            return out
        judge = Judge(Bands(), CHAIN)
        found = first_named(judge, figures, 120)
        assert not judge.thawed
        if history:
            assert found is not None and found[1] == {"attn"}, (seed, found)


def test_a_judge_state_saved_before_thaws_were_noted_loads_and_starts_them_afresh():
    judge = Judge(Bands(), CHAIN)
    figures = thawed_run(0, 1.0, 0, frozen=False)
    for i in range(30):
        judge.step(figures(i), i)
    state = judge.state_dict()
    for key in ("trained", "thawed", "params_start", "seen"):
        del state[key]
    restored = Judge(Bands(), CHAIN)
    restored.load_state_dict(state)
    for i in range(30, 60):
        assert not restored.step(figures(i), i).named
    assert not restored.thawed and restored.trained == set(CHAIN)


def test_logged_every_20_beside_gradients_every_step_the_outputs_rows_count_their_own_steps():
    """Activations every 20 steps, gradient norms every step: the outputs' rows judge from their 8th value (their
    own 20-step gaps), and a ramp x2.2 a point from point 10 is named within two of their points."""
    for seed in range(4):
        levels, rng = coarse_levels(2.2, 10, seed), random.Random(seed)
        judge, found = Judge(Bands(), CHAIN), None
        for step in range(600):
            figures = {"norm": {f"{row}.weight": math.exp(rng.gauss(0, 0.05)) for row in CHAIN}}
            if step % 20 == 0:
                figures.update(levels(step // 20))
            named = judge.step(figures, step).named
            if named and found is None:
                found = (step // 20, {f.layer for f in named})
        assert found is not None and found[1] == {"mlp"} and 10 <= found[0] <= 11, (seed, found)


def test_queries_and_keys_running_away_together_are_named():
    """Both x1.08 a point from point 60 (past x4 within their window): attention logits running away, named."""
    for seed in range(4):
        found = first_named(Judge(Bands(), ATTENTION), attention_levels(
            lambda i: 1.08 ** max(0, i - 60), lambda i: 1.08 ** max(0, i - 60), seed), 140)
        assert found is not None and found[1] & {"attn.query", "attn.key"}, (seed, found)


WEIGHTED = ["a", "b", "c", "head"]


def weighted_run(grow: float, seed: int, surge: bool, jump: float = 1.0, row: str = "b",
                 usual: float = 0.003, every: int = 1) -> list[set[str]]:
    """Four modules steady (2% noise) for 60 logged steps, each weight's update ratio falling from 0.04 to ``usual``
    a step over the first 20 (SGD's first steps on fresh weights) and staying; with ``surge`` ``row``'s rises from
    there x10 over the last 16 before its outputs grow ``grow`` a point (times ``jump`` from the first) and stays:
    the layers named at each point (logged every ``every`` steps)."""
    rng, judge = random.Random(seed), Judge(Bands(), WEIGHTED)
    named = []
    for k in range(-60, 21):
        levels = {r: math.exp(rng.gauss(0, 0.02)) * (grow ** max(0, k) * (jump if k > 0 else 1.0) if r == row else 1.0)
                  for r in WEIGHTED}
        rate = max(usual, 0.04 * (usual / 0.04) ** ((k + 60) / 20))
        rates = {r: rate * (10 ** min(1.0, max(0, k + 16) / 16) if surge and r == row else 1.0) for r in WEIGHTED}
        ratios = {f"{r}.weight": rates[r] * math.exp(rng.gauss(0, 0.05)) for r in WEIGHTED}
        found = {f.layer for f in judge.step({"level": levels, "ratio": ratios}, every * (60 + k)).named}
        assert k > 0 or not found, (k, found)
        named.append(found)
    return named[61:]


@pytest.mark.parametrize("seed", range(6))
def test_outputs_rising_as_their_own_weights_surge_are_learning_and_a_step_or_a_usual_update_size_is_not(seed):
    """``b``'s weight's update ratio (logged every step) rises x10 against the others', to 3% a step, and then its
    outputs rise 3% a point: its weights learning faster than the others' (a layer starting to learn a feature), its
    outputs no further than their updates can move them (``WEIGHT_SLACK`` times, noise and all): never named. The
    same rise with every ratio at 3% a step throughout (Adam's usual step, ``lr / rms(w)``: no surge), or with its
    ratio as the others' (no update of its own: a fault put on its outputs), is named within 20 points (at its 9th
    to 16th, as without the rule). A step x3 after the surge: named at once. The prediction layer rising so: named
    (its pull judges its growth, not its weights)."""
    assert not any(weighted_run(1.03, seed, surge=True)), seed
    for usual in (weighted_run(1.03, seed, surge=False, usual=0.03), weighted_run(1.03, seed, surge=False)):
        assert {"b"} in usual and all(named <= {"b"} for named in usual), (seed, usual)
    assert weighted_run(1.0, seed, surge=True, jump=3.0)[0] == {"b"}, seed
    assert any(weighted_run(1.03, seed, surge=True, row="head")), seed


def test_a_recorded_first_conv_learning_fast_and_a_head_asked_for_over_the_warm_ups_last_points_are_not_named():
    """The sweep's healthy GroupNorm CNN at LR 0.1, seed 2 (``unseen30``; outputs' std, the head's pull and the
    weights' update ratios as LayerHealth got them). Over steps 55-100 ``blocks.0.conv1``'s outputs rise x2.6 while
    its weight's update ratio rises x10 to 5% a step (its copies' x2-3): its weights learning, named ``blowup`` at
    steps 77-117 before the rule on a module's own weights. Its head grew x9 over steps 41-67 with the loss asking
    (pull down to -0.25), and at step 71, past it, one batch's pull was +0.21 after -0.03: named at steps 71-101
    while only the last 2 pulls' ask was remembered (``ASK_POINTS``)."""
    assert not any(recorded_names("cnn_gn_lr01_s2_healthy.json.gz").values())


def test_with_the_ask_of_the_last_2_pulls_only_the_recorded_head_is_named_at_71(monkeypatch):
    """The recording above with the ask remembered from the last ``PULL_POINTS`` pulls only: the head is named at 71."""
    from lightning_hooks.output import _judge

    monkeypatch.setattr(_judge, "ASK_POINTS", 2)
    named = recorded_names("cnn_gn_lr01_s2_healthy.json.gz")
    assert named[71] == ["model.head"] and not any(named[step] for step in named if step < 71), named


def test_a_recorded_roberta_whose_block_learns_half_again_as_far_as_its_neighbours_is_not_named(monkeypatch):
    """The sweep's healthy RoBERTa at twice its LR, seed 3, logged every step (``unseen30``; outputs' std as LayerHealth
    got them, steps 0-110). Every block's attention output grows x2-3 over steps 40-100, block 4's ahead: at step 78
    one batch's point takes its move over its window to 1.07 (log), block 3's before it 0.57 and block 5's after it
    0.87, all at even paces: 0.54 of its move, where ``NEIGHBOURS_SHARE`` at 0.55 named it at steps 78, 79 and 83."""
    from lightning_hooks.output import _peers

    assert not any(recorded_names("roberta_lr2x_s3_healthy.json.gz").values())
    monkeypatch.setattr(_peers, "NEIGHBOURS_SHARE", 0.55)
    named = {step: layers for step, layers in recorded_names("roberta_lr2x_s3_healthy.json.gz").items() if layers}
    assert named == {step: ["net.roberta.encoder.layer.4.attention.output.dense"] for step in (78, 79, 83)}, named


def test_a_recorded_bert_whose_attention_outputs_learn_more_with_depth_is_not_named_for_the_first_to_move():
    """The sweep's healthy BERT (``unseen33``, LR 1e-3, seed 3, logged every 2 steps; levels as LayerHealth got
    them, steps 0-150). Over steps 100-125 the attention outputs of blocks 2-5 rise x1.5-2 (log moves over their
    windows 0.78, 0.83, 0.74, 1.06), blocks 0-1 less (0.15, 0.30): block 2's is the first to go, with no peer before
    it that moved half as far. Judged by its std, its move is its input's (0.43) and its gain's (0.35), and block
    3's copy moved its own gain 0.36: the kind learning (``Peers.gain_alike_after``), where it was named at steps 115
    and 117."""
    assert not any(recorded_names("bert_s3_healthy.json.gz").values())


def share_run(seed: int, points: int = 170, onset: int = 140) -> list[set[str]]:
    """``b``'s weight's update ratio 1% a step for 40 points, rising over the next 60 to 3% and staying there (its
    share of the others' x1 -> x3, slowly); from ``onset`` its outputs ramp 3% a point: the layers named from then."""
    rng, judge = random.Random(seed), Judge(Bands(), WEIGHTED)
    named = []
    for i in range(points):
        share = 3.0 ** min(1.0, max(0, i - 40) / 60)
        levels = {r: math.exp(rng.gauss(0, 0.02)) * (1.03 ** max(0, i - onset) if r == "b" else 1.0) for r in WEIGHTED}
        ratios = {f"{r}.weight": 0.01 * (share if r == "b" else 1.0) * math.exp(rng.gauss(0, 0.05)) for r in WEIGHTED}
        found = {f.layer for f in judge.step({"level": levels, "ratio": ratios}, i).named}
        assert i <= onset or not found - {"b"}, (i, found)
        named.append(found)
    return named[onset + 1:]


@pytest.mark.parametrize("seed", range(3))
def test_a_share_that_rose_slowly_long_before_is_no_surge_and_a_ramp_then_is_named(seed):
    """``b``'s ratio's share rose x3 over points 40-100 and held (a layer whose steps grow against the others' over
    training, as the 12-block GPT-2's ``h.6.attn.c_proj`` under AdamW): against the window before the ramp it is its
    usual share, no surge, and the ramp from point 140 is named (against every share kept since the start it read as
    a surge and the ramp was let go)."""
    assert {"b"} in share_run(seed), seed


@pytest.mark.parametrize("seed", range(3))
def test_a_step_inside_what_a_surging_weight_could_move_is_still_named_at_once(seed):
    """Logged every 4 steps, ``b``'s ratio surged to 3% a step (x10 against the others'): a rise of x1.5 (0.41) in
    one point is within what its updates could move over the 12 steps of its last 3 moves (2 x 3% x 12 = 0.72), but
    a step is no learning (a fault's step moves its gradient in that same step): named at the first point."""
    assert weighted_run(1.0, seed, surge=True, jump=1.5, every=4)[0] == {"b"}, seed


def test_the_weighted_modules_and_their_ratio_shares_survive_the_state_dict_at_any_cadence():
    """Levels every step, update ratios every 4th: a judge saved and loaded between two ratio points keeps which
    modules are weighted and their shares, and names what the one that never stopped names (nothing, ``b`` surging
    as its outputs rise)."""
    def figures(rng, k):
        surge = 10 ** min(1.0, max(0, k + 16) / 16)
        levels = {r: math.exp(rng.gauss(0, 0.02)) * (1.03 ** max(0, k) if r == "b" else 1.0) for r in WEIGHTED}
        out = {"level": levels}
        if k % 4 == 0:
            out["ratio"] = {f"{r}.weight": 0.003 * (surge if r == "b" else 1.0) * math.exp(rng.gauss(0, 0.05))
                            for r in WEIGHTED}
        return out
    for seed in range(3):
        rng, judge, resumed = random.Random(seed), Judge(Bands(), WEIGHTED), None
        for k in range(-60, 21):
            figs = figures(rng, k)
            if k == 9:
                resumed = Judge(Bands(), WEIGHTED)
                resumed.load_state_dict(json.loads(json.dumps(judge.state_dict())))
                assert resumed.weighted == judge.weighted and "b" in resumed.weighted
                assert list(resumed.ratio_shares["b"]) == list(judge.ratio_shares["b"])
            judged = [judge.step(figs, 60 + k)] + ([resumed.step(figs, 60 + k)] if resumed is not None else [])
            assert not any(j.named for j in judged), (seed, k)
