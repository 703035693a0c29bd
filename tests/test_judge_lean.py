"""A lean that slowed to a creep before it was named is a layer's learning settling, not a ramp (docs/verdicts.md).

Fast: a recorded healthy GPT-2 under a one-cycle LR (its modules' stds, `tests/data/gpt2_onecycle_std.json`),
whose block 1 ``mlp.c_fc`` gain leaned 0.47% a step and then 0.1-0.25% (`benchmarks/unseen7.md`); and hand-built
rows: a ramp of 0.5% a step, the slowest the judge must catch, keeps its pace and never reads as slowed.
"""

from __future__ import annotations

import json
import math
import random
from collections import deque
from pathlib import Path

import pytest

from lightning_hooks.output import _judge_learning, _peers
from lightning_hooks.output._findings import Finding
from lightning_hooks.output._health_bands import Bands
from lightning_hooks.output._judge import Judge
from lightning_hooks.output._row_range import (
    Track,
    judge_value,
    lean_slowed,
    least_change,
    track_from_state,
    track_state,
)

RECORDED = Path(__file__).parent / "data" / "gpt2_onecycle_std.json"


def recorded_names(ramp: str | None = None, onset: int = 0) -> list[tuple[int, str]]:
    """The (step, module) the judge names over the recorded healthy run's first 125 steps.

    ``ramp``: a module whose std grows 2% a step from ``onset`` on (an injected ramp).
    """
    data = json.loads(RECORDED.read_text())
    judge, named = Judge(Bands(), data["modules"]), []
    for step, stds in zip(data["steps"], data["std"]):
        levels = dict(zip(data["modules"], stds))
        if ramp is not None and step >= onset:
            levels[ramp] *= math.exp(0.02 * (step - onset))
        judged = judge.step({"level": levels}, step)
        named += [(step, f.layer) for f in judged.named]
    return named


def test_a_healthy_layer_whose_lean_slowed_before_it_was_named_is_not_named(monkeypatch):
    """Block 1's ``mlp.c_fc`` gain x1.25 beyond its range by step 107, leaning 0.1% a step there: no name.

    Without the rule it is named at steps 107-119 (its std agreeing with its gain only by then), with the next copy's
    gain rule off too (``_peers.next_gain_alike``: block 2's own ``mlp.c_fc`` gain moved alike, which excuses it).
    """
    assert recorded_names() == []
    with monkeypatch.context() as patch:  # the rule alone clears it
        patch.setattr(_peers, "next_gain_alike", lambda after, mine, sign, margin: False)
        assert recorded_names() == []
    monkeypatch.setattr(_judge_learning, "lean_slowed", lambda track, floor: False)
    monkeypatch.setattr(_peers, "next_gain_alike", lambda after, mine, sign, margin: False)
    named = recorded_names()
    assert {layer for _, layer in named} == {"h.1.mlp.c_fc"} and 100 <= named[0][0] <= 120, named


@pytest.mark.parametrize("onset", [95, 101, 105])
@pytest.mark.parametrize("ramp", ["h.3.mlp.c_fc", "h.4.attn.c_attn", "h.5.mlp.c_fc"])
def test_a_lean_that_slowed_is_not_named_as_the_cause_further_up_of_a_ramp(ramp, onset):
    """A 2%-a-step ramp injected later: the healthy block 1 ``mlp.c_fc``, its lean slowed, is not named for it.

    Without the shared rule (``_leaning`` reading the tracks alone) it is named at steps 107-121 in most.
    """
    layers = {layer for _, layer in recorded_names(ramp, onset)}
    assert "h.1.mlp.c_fc" not in layers and (not layers or ramp in layers), layers


def lean_track(move, seed: int, gap: int = 2, points: int = 120) -> list[bool]:
    """``lean_slowed`` at each point of a gain row (steady to 0.5%, times ``exp(move(point))``) while it leans out."""
    rng, track, slowed = random.Random(seed), Track(deque(maxlen=32)), []
    for i in range(points):
        judge_value(track, move(i) + rng.gauss(0, 0.005), "gain", Bands(), gap=gap)
        if track.held:
            slowed.append(lean_slowed(track, least_change("gain", Bands())))
    return slowed


@pytest.mark.parametrize("gap", [2, 5])
@pytest.mark.parametrize("seed", range(4))
def test_a_ramp_of_half_a_percent_a_step_never_reads_as_slowed(gap, seed):
    """From point 40 a gain grows 0.5% a step, logged every 2 or 5 steps: it leans out and keeps its pace.

    (Logged every step, 0.5% a point is under the gain's noise floor: the row takes it in as its trend.)
    """
    slowed = lean_track(lambda i: 0.005 * gap * max(0, i - 40), seed, gap)
    assert len(slowed) >= 2 * 8 and not any(slowed), slowed


@pytest.mark.parametrize("seed", range(4))
def test_a_lean_that_stopped_reads_as_slowed(seed):
    """A gain x1.2 in 6 points, then steady (logged every 2): slowed once 8 held points passed the stop."""
    slowed = lean_track(lambda i: 0.03 * min(6, max(0, i - 40)), seed)
    assert len(slowed) >= 20 and slowed[-1] and not any(slowed[:8]), slowed


@pytest.mark.parametrize("seed", range(4))
def test_a_step_that_stays_far_out_never_reads_as_slowed(seed):
    """A gain x1.5 at point 40, held there: out past twice its least change, a step's, however still it stays."""
    slowed = lean_track(lambda i: math.log(1.5) * (i >= 40), seed)
    assert len(slowed) >= 20 and not any(slowed), slowed


def test_a_downward_lean_back_at_its_edge_reads_as_slowed():
    """A gain 30% below its range for 15 points, then back at its edge: slowed (the finding's way, down).

    Read the way of its newest value alone (0, at the edge: up), the lean looked 30% further out than before.
    """
    rng = random.Random(0)
    track = Track(deque([rng.gauss(0, 0.002) for _ in range(32)], maxlen=32), down=1.0, deviation=-0.3)
    track.held.extend([-0.3] * 15 + [0.0])
    track.held_at.extend(range(2, 34, 2))  # logged every 2 steps
    assert lean_slowed(track, least_change("gain", Bands()))


def test_a_victim_whose_lean_slowed_stays_a_victim():
    """A row counted as a victim is not let go as a lean that slowed: going further later, it is not fresh."""
    track = Track(deque([0.001 * (-1) ** i for i in range(32)], maxlen=32), down=1.0, deviation=-0.3)
    track.held.extend([-0.3] * 16)
    track.held_at.extend(range(2, 34, 2))
    judge = Judge(Bands(), ["a", "b"])
    judge.tracks = {"level": {"b": track}}
    found = Finding("b", "b", "collapse", 0.7, "level", -0.3)
    assert judge._slowed(found)
    judge.affected.add("b")
    assert not judge._slowed(found)



@pytest.mark.parametrize("seed", range(3))
def test_a_ramp_logged_across_a_resume_never_reads_as_slowed(seed):
    """A gain growing 0.5% a step, logged every 2 steps and once after 12 (a resume) as it leans out: it keeps its pace.

    Read as if every point were the newest gap apart (12 steps), the lean looked as slow as a creep there.
    """
    rng, track, slowed, step, resumed = random.Random(seed), Track(deque(maxlen=32)), [], 0, False
    for _ in range(100):
        gap = 12 if len(track.held) >= 16 and not resumed else 2
        resumed, step = resumed or gap == 12, step + gap
        judge_value(track, 0.005 * max(0, step - 80) + rng.gauss(0, 0.005), "gain", Bands(), gap=gap)
        if track.held:
            slowed.append(lean_slowed(track, least_change("gain", Bands())))
    assert resumed and len(slowed) > 40 and not any(slowed), slowed


def test_the_steps_of_held_points_survive_a_checkpoint():
    """``track_state`` keeps ``clock`` and ``held_at``."""
    track = Track(deque([0.0] * 4, maxlen=32), clock=30, held=deque([0.2, 0.3]), held_at=deque([28, 30]))
    again = track_from_state(track_state(track), 32)
    assert (again.clock, list(again.held_at), list(again.held)) == (30, [28, 30], [0.2, 0.3])
