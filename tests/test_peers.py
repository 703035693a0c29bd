"""A module against its same-kind peers before it: a move every block's copy made is learning, one block's a fault."""

import math
import random

import pytest

from lightning_hooks.output._health_bands import Bands
from lightning_hooks.output._judge import Judge
from lightning_hooks.output._peers import Peers, kind

BLOCKS = 6
KINDS = ("ln", "key")  # per block: a norm (its std steady to 0.1%), a key projection that grows as attention sharpens


def growing_keys(rng: random.Random, step: int, fault=None) -> dict[str, dict[str, float]]:
    """Every block's key std grows 1.2% a point for 60 points then settles (learning), with 3% noise;
    ``fault(step, row)`` multiplies one row."""
    growth = math.exp(0.012 * min(max(step - 40, 0), 60))
    level = {}
    for b in range(BLOCKS):
        for k in KINDS:
            row = f"enc.layer.{b}.{k}"
            base, noise = (1.0, 0.001) if k == "ln" else (0.2 * growth, 0.03)
            level[row] = base * math.exp(rng.gauss(0, noise)) * (fault(step, row) if fault else 1.0)
    return {"level": level}


def named_rows(fault=None, points: int = 160, seed: int = 0) -> list[tuple[int, str]]:
    order = [f"enc.layer.{b}.{k}" for b in range(BLOCKS) for k in KINDS]
    rng, judge, named = random.Random(seed), Judge(Bands(), order), []
    for step in range(points):
        named += [(step, f.layer) for f in judge.step(growing_keys(rng, step, fault)).named]
    return named


def test_the_kind_of_a_module_is_its_name_without_its_numbered_parts():
    assert kind("net.bert.encoder.layer.2.attention.self.key") == "net.bert.encoder.layer.#.attention.self.key"
    assert kind("model.4") == kind("model.10") == "model.#"
    assert kind("4") == "#" and kind("blocks.1.conv1") == "blocks.#.conv1"


def test_keys_growing_in_every_block_together_are_learning_not_a_fault():
    for seed in range(6):
        assert named_rows(seed=seed) == [], seed


@pytest.mark.parametrize("block", [3, 0])  # the first block's key has no peer before it: the copies after it
def test_one_blocks_key_ramping_while_all_keys_grow_is_named_first_and_alone(block):
    culprit = f"enc.layer.{block}.key"
    ramp = lambda step, row: 1.05 ** max(0, step - 70) if row == culprit else 1.0  # noqa: E731
    for seed in range(3):
        named = named_rows(ramp, seed=seed)
        assert {layer for _, layer in named} == {culprit} and 70 < named[0][0] <= 85, (seed, named[:3])


@pytest.mark.parametrize("block", [0, 3])  # the first block's key: no peer before it
def test_a_jump_is_named_at_once_and_stays_named_after_its_window_forgot_the_step(block):
    culprit = f"enc.layer.{block}.key"
    jump = lambda step, row: 10.0 if row == culprit and step >= 100 else 1.0  # noqa: E731
    named = named_rows(jump, points=200)
    assert named[:1] == [(100, culprit)] and (199, culprit) in named  # 100 points on: still out of its range


def deeper_grows_faster(rng: random.Random, step: int) -> dict[str, dict[str, float]]:
    """Each block's key grows faster than the block's before it (0.2% a point times min(block, 4) squared, for 60
    points: block 0 steady, blocks 4 and 5 x2.6), with 3% noise: a depth-wise gradient of learning."""
    level = {}
    for b in range(BLOCKS):
        growth = math.exp(0.002 * min(b, 4) ** 2 * min(max(step - 40, 0), 60))
        for k in KINDS:
            base, noise = (1.0, 0.001) if k == "ln" else (0.2 * growth, 0.03)
            level[f"enc.layer.{b}.{k}"] = base * math.exp(rng.gauss(0, noise))
    return {"level": level}


def test_a_key_whose_move_lies_between_its_neighbours_moves_is_learning_not_a_fault():
    """Block 3's key moves more than block 2's (under twice as far: no peer before made half of it) and less than
    block 4's, in its range: the recipe's gradient over depth, as an MLP-Mixer's token-mixing layers learn.
    (Block 4, whose copy after it moved as far, noise either way, may still be named: docs/verdicts.md.)"""
    order = [f"enc.layer.{b}.{k}" for b in range(BLOCKS) for k in KINDS]
    for seed in range(6):
        rng, judge = random.Random(seed), Judge(Bands(), order)
        named = {f.layer for step in range(160) for f in judge.step(deeper_grows_faster(rng, step)).named}
        assert not named & {f"enc.layer.{b}.key" for b in range(4)}, (seed, named)


@pytest.mark.parametrize("rise", [1.02, 1.03])
def test_a_sequentials_head_ramping_while_the_activation_before_it_learns_is_named_within_a_few_points(rise):
    """``Sequential(Linear, ReLU, Linear)``: ``net.0``, ``net.1`` and ``net.2`` are of one kind by name, not by
    type. All learn 1.2% a point (points 50-80, 2% noise); the head ramps ``rise`` a point from point 60 on top:
    not excused as the end of a gradient over depth while the ReLU before it moves, named before point 77
    (excused, named at points 80 and 84 at some seeds)."""
    rows = ["net.0", "net.1", "net.2"]
    for seed in range(4):
        rng, judge = random.Random(seed), Judge(Bands(), rows)
        found = None
        for i in range(100):
            level = {row: math.exp(0.012 * min(max(i - 50, 0), 30) + rng.gauss(0, 0.02)) for row in rows}
            level["net.2"] *= rise ** max(0, i - 60)
            named = {f.layer for f in judge.step({"level": level}, i).named}
            if named:
                found = i, named
                break
        assert found is not None and found[1] == {"net.2"} and found[0] < 77, (seed, found)


@pytest.mark.parametrize("seed", range(3))
def test_a_peer_that_started_late_does_not_excuse_a_step_after_the_warm_up(seed):
    """Block 1's expert steps x1.6 at point 100; block 0's, first routed at point 90, made the same move.

    With 10 values block 0's move is no one's yet (its own range would judge from ``min_points``): block 1 is named.
    Counted from ``WARM_POINTS`` values (the warm-up's peers) it excused block 1's step.
    """
    rows = ["moe.0.expert", "moe.1.expert"]
    rng, judge, named = random.Random(seed), Judge(Bands(), rows), []
    for point in range(120):
        jump = 1.6 if point >= 100 else 1.0
        level = {"moe.1.expert": jump * math.exp(rng.gauss(0, 0.01))}
        if point >= 90:
            level["moe.0.expert"] = jump * math.exp(rng.gauss(0, 0.01))
        named += [(point, f.layer) for f in judge.step({"level": level}, point).named]
    assert named and named[0] == (100, "moe.1.expert"), named


DEEP = [f"blocks.{b}.{k}" for b in range(6) for k in ("ln", "mix")]
DEEPER_RATES = (0.0, 0.005, 0.01, 0.02, 0.03, 0.04)  # each block's ``mix`` learns more than the one before


def deeper_learning(seed: int):
    """Six blocks' ``mix`` learning faster and faster from point 30 (``DEEPER_RATES`` times (i - 30)^2 / 60, to point
    90), each block more than the block before, 2% noise, their LayerNorms steady."""
    rng = random.Random(seed)

    def levels(i: int) -> dict[str, dict[str, float]]:
        grown = min(max(i - 30, 0), 60) ** 2 / 60
        out = {f"blocks.{b}.ln": math.exp(rng.gauss(0, 0.002)) for b in range(6)}
        out.update({f"blocks.{b}.mix": math.exp(DEEPER_RATES[b] * grown + rng.gauss(0, 0.02)) for b in range(6)})
        return {"level": out}
    return levels


def named_by(judge: Judge, figures_at, points: int) -> list[tuple[int, str]]:
    """Every (point, layer) ``judge`` names over ``points`` points of ``figures_at``."""
    return [(i, f.layer) for i in range(points) for f in judge.step(figures_at(i), i).named]


def test_blocks_learning_more_with_depth_and_faster_each_point_are_learning_not_a_fault():
    """Learning that grows with depth and speeds up (a BERT's attention outputs, a pre-activation ResNet's block
    inputs): a block moving past the block before's move by more than the margin, but no more than that move,
    at most 2.5 times its pace, while the block after moves further (out of its own range too): not named."""
    for seed in range(8):
        assert not named_by(Judge(Bands(), DEEP), deeper_learning(seed), 140), seed


@pytest.mark.parametrize("ramp, after, first, shared", [
    (False, True, False, True), (True, True, False, False), (False, False, False, False), (False, True, True, False)])
def test_a_move_past_a_learning_peers_is_learning_at_its_pace_with_the_copy_after_moving_on(ramp, after, first, shared):
    """Over the window block 3 moved 0.76 (log, its newest against its older half's median), block 4 1.14, block
    5 after it 1.29, all at even paces: block 4's move is their learning. Not where block 4 was flat and then made
    all of it over its newest 8 points (a ramp, 5.8 times block 3's pace there), nor where no copy after it moved
    on (a normalised block's fault), nor where block 4 is the first of its kind (``first``: no block 3; the copies
    after it are its victims)."""
    peers = Peers(32, 4)
    for i in range(32):
        mine = 1.5 * max(0, i - 23) / 8 if ramp else 1.5 * i / 31
        rows = {"blocks.4.mix": mine, "blocks.5.mix": 1.7 * i / 31 * after, "blocks.6.mix": 1.0 * i / 31 * first}
        if not first:
            rows["blocks.3.mix"] = 1.0 * i / 31
        peers.add("level", rows)
    depth = {"blocks.3.mix": 3, "blocks.4.mix": 4, "blocks.5.mix": 5, "blocks.6.mix": 6}
    out = {"blocks.4.mix", "blocks.5.mix"}
    assert peers.shared("level", "blocks.4.mix", depth, math.log(1.25), True, out) is shared

@pytest.mark.parametrize("before, after, late, name, shared", [
    (0.78, 0.98, False, "blocks.#.mix", True), (0.70, 0.98, False, "blocks.#.mix", True),
    (0.62, 0.98, False, "blocks.#.mix", False), (0.78, 0.5, False, "blocks.#.mix", False),
    (0.5, 0.98, False, "blocks.#.mix", False), (0.78, 0.98, True, "blocks.#.mix", False),
    (0.78, 0.98, False, "model.#", False)])
@pytest.mark.parametrize("up", [True, False])
def test_a_move_its_neighbours_each_made_most_of_is_a_kind_learning_at_rates_a_little_apart(before, after, late, name,
                                                                                            up, shared):
    """A healthy RoBERTa's attention outputs, every block's growing over 40 steps: block 4 rose 1.35 (log) over the
    window, block 3 before it 0.78 and block 5 after it 0.98, evenly (moves, newest against the older half's median:
    1.02, 0.59, 0.74), both in their ranges. Block 4's excess over block 3 is past the margin, and block 5 made less
    than 0.8 of its move and less than all of it: no other rule excuses it. Its neighbours each made at least
    ``NEIGHBOURS_SHARE`` (half) of it, at paces it kept: learning, either way (block 3 at 0.70: 0.52 of it). Not where
    a neighbour made less (0.62, 0.5),
    nor where block 4 made half of its rise over its newest 8 points (``late``: a ramp on its learning, its move 1.05,
    its pace there 2.9 times block 5's), nor for a
    Sequential's children (``model.3``, ``model.4``, ``model.5``: one kind by name, a fault's victim after it moving
    as far)."""
    sign = 1 if up else -1
    rows = [name.replace("#", str(b)) for b in (3, 4, 5)]
    peers = Peers(32, 4)
    for i in range(32):
        mine = 0.6 * i / 31 + 0.6 * max(0, i - 23) / 8 if late else 1.35 * i / 31
        peers.add("level", {rows[0]: sign * before * i / 31, rows[1]: sign * mine, rows[2]: sign * after * i / 31})
    depth = {row: d for d, row in enumerate(rows)}
    assert peers.shared("level", rows[1], depth, math.log(1.25), up, {rows[1]}) is shared


def test_a_gradients_move_is_compared_with_its_peers_before_it_in_backward_order():
    """Key weight gradients (log norms) over a window: block 0's, the last reached by the backward pass, moved 2.9
    with blocks 1-5 moving 2.3-2.6 (the RoBERTa's queries as its attention learns): learning. Block 3's moved 2.9
    with blocks 4-5, which the backward pass reaches first, steady: a fault, though blocks 0-2 after it in
    backward order, its victims, moved as far."""
    order = [f"enc.layer.{b}.{k}" for b in range(BLOCKS) for k in KINDS]
    for moves, row, shared in (((2.9, 2.5, 2.4, 2.6, 2.3, 2.4), 0, True), ((2.9, 2.9, 2.9, 2.9, 0.0, 0.0), 3, False)):
        judge = Judge(Bands(), order)
        for i in range(32):
            judge.peers.add("norm", {f"enc.layer.{b}.key.weight": m * i / 31 for b, m in enumerate(moves)})
        assert judge._with_peers("norm", f"enc.layer.{row}.key.weight", True) is shared, row


def test_a_gradient_going_non_finite_while_every_copy_grows_is_named_at_once():
    """Every block's key gradient growing 10% a point from point 50, block 0's NaN from point 80: a non-finite
    gradient is no move its peers share, named at 80."""
    order = [f"enc.layer.{b}.{k}" for b in range(BLOCKS) for k in KINDS]
    for seed in range(3):
        rng, judge = random.Random(seed), Judge(Bands(), order)
        for i in range(81):
            norms = {}
            for b in range(BLOCKS):
                norms[f"enc.layer.{b}.ln.weight"] = 0.01 * math.exp(rng.gauss(0, 0.05))
                norms[f"enc.layer.{b}.key.weight"] = 1e-4 * math.exp(0.1 * max(0, i - 50) + rng.gauss(0, 0.1))
            if i == 80:
                norms["enc.layer.0.key.weight"] = math.nan
            level = {f"enc.layer.{b}.{k}": math.exp(rng.gauss(0, 0.01)) for b in range(BLOCKS) for k in KINDS}
            named = judge.step({"level": level, "norm": norms}, i).named
        assert ("enc.layer.0.key", "nonfinite_grad") in {(f.layer, f.problem) for f in named}, seed
        assert "norm" in judge.peers.history  # the gradients' norms are kept for their peers


def attention_outputs(after: float, scale: float = 1.0, step: bool = False) -> tuple[Peers, list[str]]:
    """Blocks 2 and 3's attention outputs over a window of 32 points: block 2's std rising 0.78 (log) and its gain
    0.35, block 3's std steady and its gain rising ``after``; all times ``scale`` (negative: falling). ``step``: block
    2's std's newest point 3.0 further. The peers and the two rows."""
    rows = [f"enc.layer.{b}.attention.output.dense" for b in (2, 3)]
    peers = Peers(32, 4)
    for i in range(32):
        level = 0.78 * i / 31 + (3.0 if step and i == 31 else 0.0)
        peers.add("level", {rows[0]: scale * level, rows[1]: 0.0})
        peers.add("gain", {rows[0]: scale * 0.35 * i / 31, rows[1]: scale * after * i / 31})
    return peers, rows


@pytest.mark.parametrize("after, step, shared", [(0.36, False, True), (0.2, False, True), (0.6, False, True),
                                                 (0.15, False, False), (0.0, False, False), (0.36, True, False)])
@pytest.mark.parametrize("up", [True, False])
def test_a_std_whose_gains_move_the_next_copy_made_too_is_the_kinds_learning(after, step, up, shared):
    """A healthy BERT's block-2 attention output (judged by its std) rose 0.78 (log) over its window, 0.43 of it its
    input's and 0.35 its gain's; block 3's copy after it moved its own gain 0.36. A fault moves its own gain, not
    the next copy's (its input carries the move): the kind learning, where the next copy made half of it (0.2) or
    more (0.6), not less (0.15, 0.0). Not where the std's newest point alone moved past its margin (``step``): a step
    is its own, and its gain's point may not be in yet (a Falcon's query-key-value x41, its gain judged after its
    std). Down as up, twice as far (a fall's margin)."""
    margin = math.log(1.25) * (1 if up else 2)
    peers, rows = attention_outputs(after, 1 if up else -2, step)
    depth = {row: d for d, row in enumerate(rows)}
    assert peers.gain_alike_after(rows[0], depth, (margin, margin * 0.7), up, {rows[0]}) is shared


@pytest.mark.parametrize("place", ["out", "before"])
def test_a_std_whose_gains_move_only_a_copy_out_or_before_it_made_is_not_excused_by_it(place):
    """As above, block 3's gain moving as block 2's (0.36): not where block 3 is out of its own range (``out``: a
    move a peer made out of its range is a fault's), nor where the copy that moved so is the one before it (its
    copies before it are the other rule's, ``shared``, half its std's move and within the margin)."""
    peers, rows = attention_outputs(0.36)
    depth = {rows[0]: 1, rows[1]: 2 if place == "out" else 0}
    out = set(rows) if place == "out" else {rows[0]}
    assert peers.gain_alike_after(rows[0], depth, (math.log(1.25), 0.7 * math.log(1.25)), True, out) is False


def kind_moves(moves: dict[str, float], points: int = 32, seed: int = 0) -> Peers:
    """Peers whose rows each moved ``moves[row]`` (log, down where negative) as ``Peers.leads`` measures a move: the
    older half of the window at 0, then a ramp to the move, the newest 3 points there; 1% noise."""
    rng, peers = random.Random(seed), Peers(32, 4)
    for i in range(points):
        share = min(1.0, max(0.0, (i - points // 2) / (points - 3 - points // 2)))
        peers.add("level", {row: move * share + rng.gauss(0, 0.01) for row, move in moves.items()})
    return peers


@pytest.mark.parametrize("moves, ahead", [
    ((0.0, -0.1, 1.6), "enc.layers.2.out_proj"),  # a BART encoder's last attention output ramping, its copies steady
    ((0.0, -2.0, 0.1), "enc.layers.1.out_proj"),  # one copy falling x0.14: twice as far as a rise, down
    ((0.0, 0.2, 0.7), None),  # a healthy Falcon's block-1 attention output: x2 against x1.2, under the bar (x2.44)
    ((0.0, 0.15, 1.0), None),  # past the bar, but 0.85 ahead of a copy: the lead is under it
    ((0.0, -0.3, 0.5, 1.45), None),  # a pre-activation ResNet's blocks over depth: under 3x its predecessor's move
    ((0.0, 0.1, -1.2), None),  # x0.3 down: past the bar up, not twice as far
])
def test_a_copy_far_ahead_of_every_copy_of_its_kind_is_outpacing_it(moves, ahead):
    """``Peers.outpaced``: a row moved 4 margins (x2.44 at ``level_factor`` 1.25) over its window, as far ahead of
    every copy of its kind, and 3 times as far as each one that moved its way; down, twice as far (log). Each case
    but the first two fails one of these alone."""
    rows = [f"enc.layers.{b}.out_proj" for b in range(len(moves))]
    found = kind_moves(dict(zip(rows, moves))).outpaced("level", math.log(1.25))
    assert list(found) == ([ahead] if ahead else []), found
    if ahead:
        assert math.copysign(1.0, found[ahead]) == math.copysign(1.0, moves[rows.index(ahead)])


def test_a_sequentials_children_and_a_kind_of_two_are_not_judged_by_their_copies():
    """``model.#``'s children are one kind by name only (a victim after a fault moves as far); two copies are too
    few to say which one moved alone. Nor a row with fewer than 8 points."""
    assert kind_moves({"model.2": 0.0, "model.4": 0.0, "model.6": 1.6}).outpaced("level", math.log(1.25)) == {}
    assert kind_moves({"h.0.attn": 0.0, "h.1.attn": 1.6}).outpaced("level", math.log(1.25)) == {}
    few = kind_moves({f"h.{b}.attn": m for b, m in enumerate((0.0, 0.0, 1.6))}, points=7)
    assert few.outpaced("level", math.log(1.25)) == {}


@pytest.mark.parametrize("before, traced", [((0.0, 0.0, -0.7), True), ((0.8, 0.0, 0.02), False)])
def test_a_copy_outpacing_its_kind_is_traced_back_to_the_module_before_it_that_led_its_own_the_same_way(before,
                                                                                                      traced):
    """Block 2's attention output fell x0.14 (-2.0, log) over its window, its copies steady. Its query projection
    (the module before it) fell -0.7, a third as far and past a margin ahead of its own copies: the fall is traced
    to it, and it is out (``collapse``). Not where the query projection moved the other way (+0.02) while a copy
    rose 0.8: 0.78 from that copy, but no lead of its own its way."""
    order = [f"enc.layers.{b}.{part}" for b in range(3) for part in ("q_proj", "out_proj")]
    moves = {f"enc.layers.{b}.q_proj": m for b, m in enumerate(before)}
    moves.update({f"enc.layers.{b}.out_proj": m for b, m in enumerate((0.0, 0.05, -2.0))})
    judge = Judge(Bands(), order)
    judge.peers, judge.levels = kind_moves(moves), dict.fromkeys(order, 1.0)
    found = judge._outpaced(judge.levels, ())
    expected = "enc.layers.2.q_proj" if traced else "enc.layers.2.out_proj"
    assert [(f.row, f.problem) for f in found] == [(expected, "collapse")], found


def encoder(point: int, rng: random.Random, onset: int | None) -> dict[str, float]:
    """Three encoder blocks' modules over points logged every 5 steps: their first 6 points swing x4 up and back
    together (the warm-up's learning), then steady with 10% noise; ``layers.2.out_proj`` x1.25 a point (4.5% a
    step) from ``onset`` on."""
    swing = 4.0 ** math.sin(math.pi * min(point, 6) / 6)
    levels = {}
    for b in range(3):
        for part, base in (("norm", 1.0), ("q_proj", 0.3), ("out_proj", 0.03), ("fc2", 0.1)):
            row = f"enc.layers.{b}.{part}"
            ramp = 1.25 ** (point - onset) if onset is not None and point >= onset and row.endswith("2.out_proj") else 1
            levels[row] = base * (swing if part != "norm" else 1.0) * ramp * math.exp(rng.gauss(0, 0.1))
    return levels


@pytest.mark.parametrize("seed", range(3))
def test_a_ramp_begun_in_the_warm_up_is_named_as_it_outpaces_its_copies(seed):
    """A BART encoder's last attention output ramping 4.5% a step from step 50 (logged every 5, in the judge's
    warm-up of 120 steps), its two copies steady: its own range takes the ramp in as its trend (named 19 points on,
    or never); it is x2.44 ahead of its copies 8-9 points on, and named then, first and alone. Its healthy run:
    nothing."""
    order = [f"enc.layers.{b}.{part}" for b in range(3) for part in ("norm", "q_proj", "out_proj", "fc2")]
    for onset in (10, None):
        rng, judge, found = random.Random(seed), Judge(Bands(), order), {}
        for point in range(50):
            layers = [f.layer for f in judge.step({"level": encoder(point, rng, onset)}, 5 * point).named]
            if layers:
                found[point] = layers
        if onset is None:
            assert found == {}, found
        else:
            assert found and onset < min(found) <= onset + 10, found
            assert all(layers == ["enc.layers.2.out_proj"] for layers in found.values()), found
