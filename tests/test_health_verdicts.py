"""The one judge: each layer against its own history and its peers; the culprit named, its victims not."""

import json
import math
import random

import pytest

from lightning_hooks.output import _judge
from lightning_hooks.output._health_verdicts import EVERY_LAYER, Bands, Verdicts
from lightning_hooks.output._judge import Judge

LAYERS = [f"net.{i}" for i in range(6)]


def healthy(rng: random.Random, step: int) -> dict[str, dict[str, float]]:
    """Six layers learning: outputs drifting slowly with noise, gradients and update ratios following one
    warm-up-then-cosine schedule with minibatch noise shared by every layer."""
    lr = min(1.0, (step + 1) / 20) * (0.55 + 0.45 * math.cos(math.pi * step / 400))
    batch = math.exp(rng.gauss(0, 0.3))
    return {"level": {name: (1 + i) * (1 + step / 400) * math.exp(rng.gauss(0, 0.03)) for i, name in enumerate(LAYERS)},
            "norm": {f"{n}.weight": batch * (0.1 + i) / (1 + step / 50) * math.exp(rng.gauss(0, 0.1))
                     for i, n in enumerate(LAYERS)},
            "ratio": {f"{n}.weight": lr * 1e-2 * (1 + i) * math.exp(rng.gauss(0, 0.05)) for i, n in enumerate(LAYERS)}}


def run(fault, steps: int = 120, seed: int = 0, make=None) -> list[tuple[int, list[tuple[str, str]]]]:
    """Feed ``steps`` logged steps (``make``'s, else :func:`healthy`'s) to a Judge, ``fault(step, figures)``
    changing them; each step's named layers."""
    rng, judge, named = random.Random(seed), Judge(Bands()), []
    for step in range(steps):
        figures = (make or healthy)(rng, step)
        fault(step, figures)
        named.append((step, [(f.layer, f.problem) for f in judge.step(figures).named]))
    return named


def first_named(named):
    return next(((step, layers) for step, layers in named if layers), None)


def scale(figure: str, rows: list[str], by) -> callable:
    def fault(step, figures):
        for row in rows:
            figures[figure][row] *= by(step)
    return fault


def test_a_healthy_run_on_a_schedule_is_never_judged():
    assert first_named(run(lambda step, figures: None, steps=300)) is None


def test_a_jump_in_a_middle_layer_names_it_at_once_and_not_the_layers_after_it_it_moved():
    jump = scale("level", LAYERS[2:], lambda s: 20.0 if s >= 60 else 1.0)  # net.2, and what follows it
    assert first_named(run(jump)) == (60, [("net.2", "blowup")])


def test_a_slow_ramp_is_named_within_a_few_points_and_does_not_widen_its_own_range():
    ramp = scale("level", LAYERS[3:], lambda s: 1.08 ** max(0, s - 60))
    step, layers = first_named(run(ramp))
    assert layers == [("net.3", "blowup")] and 60 < step <= 66
    named = dict(run(ramp))
    assert all(("net.3", "blowup") in named[s] for s in range(step, step + 10))  # still named as it keeps rising


def test_outputs_that_vanish_in_one_layer_name_it_and_not_the_gradients_upstream():
    def vanish(step, figures):
        if step >= 60:
            for i, name in enumerate(LAYERS):
                if i >= 2:
                    figures["level"][name] *= 1e-3
                else:
                    figures["norm"][f"{name}.weight"] *= 1e-3
    assert first_named(run(vanish)) == (60, [("net.2", "collapse")])


def test_a_learning_rate_raised_in_one_group_is_judged_against_the_others_not_a_fixed_band():
    fast = scale("ratio", ["net.4.weight"], lambda s: 100.0 if s >= 60 else 1.0)
    assert first_named(run(fast)) == (60, [("net.4", "too_fast")])


def test_every_layer_at_once_is_the_batch_not_a_layer():
    data = scale("level", LAYERS, lambda s: 30.0 if s >= 60 else 1.0)
    assert first_named(run(data)) == (60, [(EVERY_LAYER, "data")])
    labels = scale("norm", [f"{n}.weight" for n in LAYERS], lambda s: 10.0 if s >= 60 else 1.0)
    assert first_named(run(labels)) == (61, [(EVERY_LAYER, "data")])  # the gradients stayed up: not one hard batch


def test_one_hard_batch_that_moves_every_gradient_is_not_named():
    hard = scale("norm", [f"{n}.weight" for n in LAYERS], lambda s: 10.0 if s in (60, 90) else 1.0)
    assert first_named(run(hard)) is None


def chain(rng: random.Random, step: int, own: float = 0.01) -> dict[str, dict[str, float]]:
    """Six modules in a chain whose std moves with the batch (a factor shared by every module), as in an MLP."""
    batch = math.exp(rng.gauss(0, 0.08))
    return {"level": {name: batch * (1 + i) * math.exp(rng.gauss(0, own)) for i, name in enumerate(LAYERS)}}


def run_chain(fault, steps: int = 120, seed: int = 0) -> list[tuple[int, list[tuple[str, str]]]]:
    return run(fault, steps, seed, make=chain)


def test_a_ramp_under_batch_noise_is_named_by_its_gain_before_it_grows_a_third():
    # Each module's std moves 8% with the batch, its gain (over the module before it) 1.4%: a ramp of net.3's
    # own gain, 4% a point, is named before it is up 30% (its std alone would need the batch's noise passed), but for
    # the point its first point out waits (``_first_leans``).
    ramp = scale("level", LAYERS[3:], lambda s: 1.04 ** max(0, s - 60))
    step, layers = first_named(run_chain(ramp))
    assert layers == [("net.3", "blowup")] and 60 < step < 60 + math.log(1.3) / math.log(1.04) + 1
    assert first_named(run_chain(lambda step, figures: None, steps=400)) is None


@pytest.fixture
def any_lean(monkeypatch):
    """The wait's mechanics on any lean (``LEAN_AGE`` 0): a synthetic row's step has no lean before it."""
    monkeypatch.setattr(_judge, "LEAN_AGE", 0)


@pytest.mark.parametrize("seed", range(8))
def test_a_rise_from_a_row_not_leaning_is_named_at_once(seed):
    """``net.3`` (and what follows it) x1.45 for one point at step 80, on a chain steady before: a step, no slow lean
    one batch took over its bound, named at once (``LEAN_AGE``: a lean under 12 steps old is a ramp's or none)."""
    fault = scale("level", LAYERS[3:], lambda s: 1.45 if s == 80 else 1.0)
    assert first_named(run_chain(fault, seed=seed)) == (80, [("net.3", "blowup")])


@pytest.mark.parametrize("seed", range(8))
def test_outputs_just_out_for_one_point_wait_for_the_next_and_a_jump_does_not(seed, any_lean):
    """A chain whose stds move 8% with the batch: ``net.3`` (and what follows it) x1.45 for one point at step 80,
    past its bound (x1.25), within twice it, and back at the next: nothing named (``_first_leans``). For ten points:
    named at the second. x2, past twice the bound: named at once; so is a fall for one point (x0.6: a fall's bound
    is twice a rise's already). (Named at step 80 in every case before the rule.)"""
    def at(points, by):
        return first_named(run_chain(scale("level", LAYERS[3:], lambda s: by if s in points else 1.0), seed=seed))

    assert at({80}, 1.45) is None
    assert at(set(range(80, 90)), 1.45) == (81, [("net.3", "blowup")])
    assert at({80}, 2.0) == (80, [("net.3", "blowup")])
    assert at({80}, 0.6) == (80, [("net.3", "collapse")])


def waiting_runs(seed: int) -> dict[str, list]:
    """Chains where a first point out waits: a blip, a step that stays, a lean led by a gain whose input falls,
    every module's outputs up at once (the batch: the first module's step, judged at once), and a blip before a step
    that stays (the blip waits as the culprit; at the next point the step, out at the last, is named at once)."""
    def led(step, figures):  # ``net.3``'s gain rises 10% a point from 60, ``net.2`` falls 15% a point from 62
        k = max(0, step - 60)
        for d, name in enumerate(LAYERS):
            figures["level"][name] *= (1.1 ** k if d >= 3 else 1.0) * (0.85 ** max(0, k - 2) if d >= 2 else 1.0)
    return {"blip": scale("level", LAYERS[3:], lambda s: 1.45 if s == 80 else 1.0),
            "step": scale("level", LAYERS[3:], lambda s: 1.45 if s >= 80 else 1.0), "led": led,
            "batch": scale("level", LAYERS, lambda s: 1.45 if s >= 80 else 1.0),
            "two": together(scale("level", ["net.2"], lambda s: 1.5 if s == 80 else 1.0),
                            scale("level", LAYERS[4:], lambda s: 1.45 if s >= 80 else 1.0))}


@pytest.mark.parametrize("seed", range(3))
def test_a_judge_restored_at_every_step_names_what_one_never_stopped_names(seed, any_lean):
    """The wait's memory (the modules out at the last step, the culprit that waited) is the judge's state: a judge
    saved and restored at every step (JSON) names the same layers at the same steps, across the waits."""
    for name, fault in waiting_runs(seed).items():
        rng, judge, resumed = random.Random(seed), Judge(Bands()), Judge(Bands())
        for step in range(100):
            figures = chain(rng, step)
            fault(step, figures)
            again = Judge(Bands())
            again.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
            resumed = again
            assert ([(f.layer, f.problem) for f in resumed.step(figures).named]
                    == [(f.layer, f.problem) for f in judge.step(figures).named]), (name, step)
        assert judge.outs_before == resumed.outs_before and judge.waited == resumed.waited


def test_a_first_point_out_waits_across_steps_that_hold_no_outputs(any_lean):
    """Gradients every step, outputs every other: ``net.3``'s one-point blip at step 80 names nothing; a step that
    stays is named at the next step holding outputs (82), not at the gradients-only step between."""
    for fault, first in ((lambda s: 1.45 if s == 80 else 1.0, None), (lambda s: 1.45 if s >= 80 else 1.0, 82)):
        rng, judge, named = random.Random(0), Judge(Bands()), []
        for step in range(100):
            figures = chain(rng, step)
            figures["norm"] = {f"{n}.weight": math.exp(rng.gauss(0, 0.1)) for n in LAYERS}
            scale("level", LAYERS[3:], fault)(step, figures)
            if step % 2:
                del figures["level"]
            named += [(step, f.layer) for f in judge.step(figures, step).named]
        assert (named[0] if named else (None,))[0] == first, named[:3]
        assert all(layer == "net.3" for _, layer in named), named[:3]


def together(*faults):
    def fault(step, figures):
        for one in faults:
            one(step, figures)
    return fault


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_a_rise_just_past_its_bound_with_another_row_out_is_judged_at_once(seed, any_lean):
    """``net.3``'s outputs x1.45 from step 80 (within twice the bound: alone, they wait a point) while ``net.1``'s
    update ratio goes x8 (a row out beside them): the step is judged at once, ``net.3`` named at 80, not ``net.1``.
    (Seed 2's ``net.3`` is named late with or without the rule, this generator's x1.45 at its edge.)"""
    fault = together(scale("level", LAYERS[3:], lambda s: 1.45 if s >= 80 else 1.0),
                     scale("ratio", ["net.1.weight"], lambda s: 8.0 if s >= 80 else 1.0))
    assert first_named(run(fault, seed=seed)) == (80, [("net.3", "blowup")])


@pytest.mark.parametrize("seed", range(4))
def test_a_cause_further_up_going_out_as_a_waiting_culprit_is_confirmed_is_named(seed, any_lean):
    """``net.3`` x1.45 for one point at step 80 (it waits), then ``net.1`` and everything after it x20 from 81: at 81
    ``net.1``, before the culprit that waited and far past the wait's bound, is named (a cause further up), not taken
    for the waiting one's victim."""
    fault = together(scale("level", LAYERS[3:], lambda s: 1.45 if s == 80 else 1.0),
                     scale("level", LAYERS[1:], lambda s: 20.0 if s >= 81 else 1.0))
    step, layers = first_named(run(fault, seed=seed))
    assert step == 81 and ("net.1", "blowup") in layers, (step, layers)


@pytest.mark.parametrize("seed", [0, 1, 3, 4])
def test_a_waiting_culprit_named_for_another_problem_keeps_its_name_when_its_outputs_come_back(seed, any_lean):
    """``net.3``'s outputs x1.45 for one point at step 80 (they wait) while its attention entropy collapses from 80
    on (named there: a stability figure is named at once); from 81 ``net.5``'s update ratio x8. ``net.3`` stays
    named while its entropy stays collapsed, ``net.5`` its victim: its outputs back in range at 81 do not take away
    a name the wait did not give. (Seed 2's blip is named at once, this generator's x1.45 at its edge.)"""
    def entropy(step, figures):
        figures["attention_entropy"] = {"net.3": 0.01 if step >= 80 else 2.0}
    fault = together(scale("level", LAYERS[3:], lambda s: 1.45 if s == 80 else 1.0), entropy,
                     scale("ratio", ["net.5.weight"], lambda s: 8.0 if s >= 81 else 1.0))
    named = run(fault, seed=seed)
    assert first_named(named) == (80, [("net.3", "entropy_collapse")])
    assert all(layers == [("net.3", "entropy_collapse")] for step, layers in named[80:90]), named[80:90]


@pytest.mark.parametrize("seed", [0, 1, 3, 4])
def test_a_lone_gradient_spike_as_a_waiting_culprit_comes_back_is_not_named(seed, any_lean):
    """``net.3``'s outputs x1.45 for one point at step 80 (they wait), back in range at 81, where ``net.1``'s
    gradient norm is x14 for that one step: nothing is named. The waiting culprit, named through step 81 to be
    judged, is not named at all; a lone gradient spike with no layer named is not a fault (``_lone_spikes``).
    (Seed 2's blip is named at once, this generator's x1.45 at its edge.)"""
    fault = together(scale("level", LAYERS[3:], lambda s: 1.45 if s == 80 else 1.0),
                     scale("norm", ["net.1.weight"], lambda s: 14.0 if s == 81 else 1.0))
    assert first_named(run(fault, seed=seed)) is None


def grads(rng: random.Random, step: int) -> dict[str, dict[str, float]]:
    """Six layers whose gradient norms move together with the batch (25%), each 3% on its own; outputs steady."""
    batch = math.exp(rng.gauss(0, 0.25))
    return {"level": {n: (1 + i) * math.exp(rng.gauss(0, 0.02)) for i, n in enumerate(LAYERS)},
            "norm": {f"{n}.weight": batch * (1 + i) * math.exp(rng.gauss(0, 0.03)) for i, n in enumerate(LAYERS)}}


def run_resumed(fault, make, seed: int, steps: int = 120) -> list[tuple[int, list[tuple[str, str]]]]:
    """As :func:`run`, the judge saved and restored (JSON) before every step."""
    rng, judge, named = random.Random(seed), Judge(Bands()), []
    for step in range(steps):
        figures = make(rng, step)
        fault(step, figures)
        again = Judge(Bands())
        again.load_state_dict(json.loads(json.dumps(judge.state_dict())))
        judge = again
        named.append((step, [(f.layer, f.problem) for f in judge.step(figures).named]))
    return named


@pytest.mark.parametrize("seed", range(4))
def test_a_gradient_norm_just_past_its_bound_on_a_long_lean_waits_a_point(seed):
    """``net.4``'s gradient norm leans out x2 from step 60 (under its x4 bound: held, not named). At step 80, 20 steps
    into the lean, one batch takes it x3 further (x6, past its bound, within twice it) for one point: nothing named
    (one batch on a slow lean). Staying there: named at the next point. x40 (past twice the bound): named at once;
    so is x3 four steps into the lean (a young lean: a ramp's pace). A judge restored at every step names the same.
    (Before the rule: named at 80 for the one point.)"""
    def lean(by, points):
        return scale("norm", ["net.4.weight"], lambda s: (2.0 if s >= 60 else 1.0) * (by if s in points else 1.0))

    cases = {"blip": (lean(3.0, {80}), None), "stays": (lean(3.0, set(range(80, 120))), (81, [("net.4", "exploding")])),
             "far": (lean(40.0, {80}), (80, [("net.4", "exploding")])),
             "young": (lean(3.0, {64}), (64, [("net.4", "exploding")]))}
    for name, (fault, expected) in cases.items():
        assert first_named(run(fault, seed=seed, make=grads)) == expected, name
        assert run_resumed(fault, grads, seed) == run(fault, seed=seed, make=grads), name


@pytest.mark.parametrize("seed", range(4))
def test_a_gradient_norm_logged_every_other_step_waits_a_point_of_its_own(seed):
    """As above, ``net.4``'s gradient norm logged at even steps only (the others at every step: a router's expert not
    picked at odd ones), its lean from step 56: x3 further at step 80 for one point names nothing; staying, it is
    named at its next point (82): a step without its row keeps what it was at its last."""
    def sparse(fault):
        def at(step, figures):
            fault(step, figures)
            if step % 2:
                del figures["norm"]["net.4.weight"]
        return at

    def lean(points):
        return scale("norm", ["net.4.weight"], lambda s: (2.0 if s >= 56 else 1.0) * (3.0 if s in points else 1.0))

    assert first_named(run(sparse(lean({80})), seed=seed, make=grads)) is None
    assert first_named(run(sparse(lean(set(range(80, 120)))), seed=seed, make=grads)) == (82, [("net.4", "exploding")])


@pytest.mark.parametrize("points", [30, 60])  # a cycle of 60 steps logged every 2 or every step
def test_a_layer_swinging_with_a_cyclic_learning_rate_is_not_named(points):
    swing = scale("level", LAYERS[3:], lambda s: 1.3 ** -math.cos(2 * math.pi * s / points))
    assert first_named(run_chain(swing, steps=400)) is None


def test_a_nan_born_in_one_module_names_that_module_not_those_after_it_or_the_gradients():
    def nan(step, figures):
        if step >= 60:
            figures["nonfinite"] = {name: float(i >= 3) for i, name in enumerate(LAYERS)}
            figures["norm"] = {row: math.nan for row in figures["norm"]}
    step, layers = first_named(run(nan))
    assert step == 60 and ("net.3", "nonfinite") in layers and {layer for layer, _ in layers} == {"net.3"}


def test_verdicts_judge_a_steps_figures_together_and_summarise_the_culprit_with_its_victims_counted():
    rng, verdicts = random.Random(1), Verdicts(Bands())
    for step in range(80):
        figures = healthy(rng, step)
        if step >= 60:
            for name in LAYERS[2:]:
                figures["level"][name] *= 20.0
        for figure, values in figures.items():  # in several calls, as the monitors deliver them
            verdicts.add(figure, step, values)
    summary = verdicts.summary(top_k=3).splitlines()
    assert summary[0].startswith("Layer health at step 79: 1 layer unhealthy now (3 other rows out since step 60")
    assert summary[1:3] == ["  outputs blowing up: activation std above its usual range",
                            "    net.2                    worst " + summary[2].split("worst ")[1]]
    assert summary[2].endswith("since step 60")
    restored = Verdicts(Bands())
    restored.load_state_dict(verdicts.state_dict())
    assert restored.summary(top_k=3) == verdicts.summary(top_k=3)


def test_zeros_nans_and_infinities_are_judged_without_error():
    judge = Judge(Bands())
    for _ in range(30):
        judged = judge.step({"ratio": {"a.weight": 0.0, "b.weight": 0.0, "c.weight": math.inf},
                             "norm": {"a.weight": math.nan, "b.weight": 0.0, "c.weight": 1.0},
                             "level": {"a": 1.0, "b": math.nan, "c": 0.0}, "nonfinite": {"b": 1.0}})
    assert ("b", "nonfinite") in [(f.layer, f.problem) for f in judged.named]


@pytest.mark.parametrize("kwargs, match", [
    ({"level_factor": 1.0}, r"`level_factor` must be a finite number > 1, got 1"),
    ({"window": 3}, r"`window` must be"),
    ({"min_points": 40}, r"`min_points` must be at most `window` \(32\), got 40"),
])
def test_bands_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Bands(**kwargs)
