"""A module's outputs judged by their gain: the finding stands only where its own outputs moved the same way."""

import math
import random

from lightning_hooks.output._diagnosis import diagnose
from lightning_hooks.output._health_verdicts import Bands, Verdicts
from lightning_hooks.output._judge import Judge

LAYERS = [f"net.{i}" for i in range(6)]


def chain(rng: random.Random, step: int) -> dict[str, dict[str, float]]:
    """Six modules in a chain whose std moves 3% with the batch and 1% on its own: each judged by its gain."""
    batch = math.exp(rng.gauss(0, 0.03))
    return {"level": {name: batch * (1 + i) * math.exp(rng.gauss(0, 0.01)) for i, name in enumerate(LAYERS)}}


def named(fault, steps: int = 120, seed: int = 0) -> list[tuple[int, str, str]]:
    """Each ``(step, layer, problem)`` a Judge names on :func:`chain`'s steps, ``fault(step, levels)`` changing them."""
    rng, judge, found = random.Random(seed), Judge(Bands()), []
    for step in range(steps):
        figures = chain(rng, step)
        fault(step, figures["level"])
        found.extend((step, f.layer, f.problem) for f in judge.step(figures).named)
    return found


def dip(step: int, levels: dict[str, float]) -> None:
    """From step 60, net.2's std falls to x0.78 (inside its own range) and the modules after it only to x0.97.

    net.3's gain rises x1.24, beyond its range, while its own std fell: net.3 passed on less of the
    dip than it got (as a ReLU's quiet output under a shrunk input), not a blow-up of its own.
    """
    if step >= 60:
        levels["net.2"] *= 0.78
        for name in LAYERS[3:]:
            levels[name] *= 0.97


def test_a_gain_that_rose_while_the_outputs_fell_is_not_a_blowup():
    for seed in range(3):
        assert named(dip, seed=seed) == []


def test_a_gain_that_rose_with_the_outputs_is_still_named_at_once():
    def jump(step: int, levels: dict[str, float]) -> None:
        for name in LAYERS[3:]:
            levels[name] *= 1.4 if step >= 60 else 1.0
    for seed in range(3):
        assert named(jump, seed=seed)[0] == (60, "net.3", "blowup")


def test_a_layer_named_by_its_gain_stays_named_while_its_gain_is_out():
    def jump(step: int, levels: dict[str, float]) -> None:
        for name in LAYERS[3:]:
            levels[name] *= 1.4 if step >= 60 else 1.0
    steps = {step for step, layer, _ in named(jump) if layer == "net.3"}
    assert steps == set(range(60, 120))


def test_the_diagnosis_of_outputs_judged_by_their_gain_gives_the_gains_own_numbers():
    rng, verdicts = random.Random(0), Verdicts(Bands())
    for step in range(80):
        figures = chain(rng, step)
        for name in LAYERS[3:]:
            figures["level"][name] *= 1.4 if step >= 60 else 1.0
        verdicts.add("level", step, figures["level"])
    said = diagnose(verdicts, 5)
    assert "net.3: outputs blowing up since step 60" in said
    gain = said.split("judged by its gain (its output std over net.2's, the quieter figure): ")[1]
    now, times = float(gain.split(" now")[0]), float(gain.split(", x")[1].split(" ")[0])
    assert 1.3 < times < 1.5 and 1.0 < now < 2.0  # net.3 / net.2 = 4/3 usually, x1.4 now


def test_episodes_of_one_step_are_listed_in_forward_order_before_the_problem_kind():
    verdicts = Verdicts(Bands())
    verdicts.judge.depth.update({name: i for i, name in enumerate(LAYERS)})
    verdicts.add("level", 0, {name: 1.0 for name in LAYERS})
    verdicts.flush()
    for problem, row in (("blowup", "net.4"), ("too_fast", "net.2.weight")):  # a cause upstream, what it did after
        verdicts._note(problem, row, 5, 1.0)
    ongoing = sorted(((p, row, e) for (p, row), e in verdicts.episodes.items()), key=verdicts.order)
    assert [row for _, row, _ in ongoing] == ["net.2.weight", "net.4"]


def test_at_one_step_the_gradients_a_fault_sent_back_upstream_come_after_its_outputs():
    """A NaN born in net.4 makes every gradient before it non-finite at once: net.4's outputs come first."""
    verdicts = Verdicts(Bands())
    verdicts.judge.depth.update({name: i for i, name in enumerate(LAYERS)})
    verdicts.add("level", 0, {name: 1.0 for name in LAYERS})
    verdicts.flush()
    for problem, row in (("nonfinite_grad", "net.0.weight"), ("exploding", "net.2.weight"), ("nonfinite", "net.4")):
        verdicts._note(problem, row, 5, 1.0)
    ongoing = sorted(((p, row, e) for (p, row), e in verdicts.episodes.items()), key=verdicts.order)
    assert [row for _, row, _ in ongoing] == ["net.4", "net.0.weight", "net.2.weight"]


ATTENTION = ["enc.0.norm", "enc.1.attn.query", "enc.1.attn.key", "enc.1.attn.value", "enc.1.attn.out", "enc.1.norm"]


def attention(rng: random.Random, step: int, ramp_from: int) -> dict[str, dict[str, float]]:
    """A block's input norm and its three projections of it, each moving 3% with the batch and 1% on its own; the
    query grows 4% a step from ``ramp_from``, and the attention output after them with it."""
    batch, ramp = math.exp(rng.gauss(0, 0.03)), 1.04 ** max(0, step - ramp_from)
    level = {name: batch * (1 + i) * math.exp(rng.gauss(0, 0.01)) for i, name in enumerate(ATTENTION)}
    level["enc.1.attn.query"] *= ramp
    level["enc.1.attn.out"] *= ramp
    return {"level": level}


def test_a_key_is_judged_against_the_input_it_shares_with_its_query_not_against_the_query():
    """Forward order runs an attention's query, key and value one after the other, but each is a projection of the
    block's input: the key's gain is its std over the input's, not over the query's. A query ramping from step 60 is
    named first, and the key (its std steady) never: against the query its gain would fall 4% a step (``collapse``).
    """
    for seed in range(3):
        rng, judge, found = random.Random(seed), Judge(Bands(), ATTENTION), []
        for step in range(120):
            found += [(step, f.layer) for f in judge.step(attention(rng, step, 60), step).named]
        assert judge._before()["enc.1.attn.key"] == judge._before()["enc.1.attn.query"] == "enc.0.norm"
        assert judge._before()["enc.1.attn.out"] == "enc.1.attn.value"
        assert found and found[0][1] == "enc.1.attn.query" and all(layer != "enc.1.attn.key" for _, layer in found), \
            (seed, found[:4])
