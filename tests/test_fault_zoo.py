"""The fault zoo's goals, on a representative subset: the culprit named first, at once or before the loss moved.

Each case trains a small real model with the package's monitors and LayerHealth (see
``benchmarks/fault_zoo.py``); the whole zoo is ``python benchmarks/fault_zoo.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fault_zoo import RECIPES, Lit, judge_case, run_case  # noqa: E402

STEPS, ONSET, EVERY = 200, 100, 2
ABRUPT = ("jump", "dead", "vanish", "lr100", "nan", "gradvanish")


@pytest.fixture(scope="module")
def healthy() -> dict:
    return {model: run_case(model, None, STEPS, ONSET, EVERY) for model in ("mlp", "gpt2", "cnn")}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "gpt2"])
def test_a_healthy_recipe_gets_no_verdict_after_the_first_tenth(healthy, model):
    row = judge_case(healthy[model], None)
    assert row["alarms"] == 0, row["lines"]


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, "swing"])
def test_a_cyclic_learning_rate_and_a_layer_swinging_with_it_get_no_verdict(fault):
    # mlp-cyclic: Adam with a triangular LR cycle of 60 steps; "swing": one middle Linear's outputs x1.3 at
    # the LR's peak and /1.3 at its trough, every cycle (its range holds its own swings).
    row = judge_case(run_case("mlp-cyclic", fault, STEPS, ONSET, EVERY), None)
    assert row["alarms"] == 0, row["lines"]


@pytest.mark.slow
@pytest.mark.parametrize("model, growth", [("mlp", 1.08), ("cnn", 1.015)])
def test_a_faster_or_slower_ramp_is_named_first_before_the_loss_moved(healthy, model, growth):
    case = run_case(model, "ramp", STEPS, ONSET, EVERY, growth=growth)
    row = judge_case(case, healthy[model])
    assert row["before"] == 0 and row["first"].startswith(case.culprit), row
    assert row["delay"] is not None and (row["loss5"] is None or row["delay"] < row["loss5"]), row


@pytest.mark.slow
@pytest.mark.parametrize("model, fault", [("mlp", "jump"), ("mlp", "nan"), ("mlp", "lr100"), ("cnn", "vanish"),
                                          ("cnn", "dead"), ("gpt2", "ramp"), ("gpt2", "dead"), ("mlp", "gradvanish")])
def test_the_culprit_is_named_first_and_nobody_before_it(healthy, model, fault):
    case = run_case(model, fault, STEPS, ONSET, EVERY)
    row = judge_case(case, healthy.get(model))
    assert row["before"] == 0, row["before_names"]
    assert row["first"].startswith(case.culprit), row
    judged_by = "output gradients" if fault == "gradvanish" else "outputs"  # its outputs never moved
    assert (case.leader, case.extra["judged_by"]) == (case.culprit, judged_by)  # the flight record's leader too
    if fault in ABRUPT:
        assert row["delay"] < EVERY  # the first logged step after the onset
    else:
        assert row["delay"] is not None and (row["loss5"] is None or row["delay"] < row["loss5"]), row


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "gpt2"])
def test_a_bad_batch_is_every_layer_at_once_not_one_layer(healthy, model):
    row = judge_case(run_case(model, "data", STEPS, ONSET, EVERY), healthy[model])
    assert row["first"] == "(every layer) (data)" and row["delay"] < EVERY and row["named_at_once"] == 1
    assert row["leader"] == "(every layer)" and row["judged_by"] == "outputs"  # the flight record says so too


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_logged_every_step_the_fastest_learning_is_history_and_a_ramp_is_named_first(seed):
    # Logged every step, the MLP's layers move 20-80% over steps 25-60 while its loss falls 4x: judged from its
    # 24th logged value alone, 1-2 healthy layers were named there, and named before the ramp's culprit.
    healthy_run = run_case("mlp", None, STEPS, ONSET, 1, seed)
    assert judge_case(healthy_run, None)["alarms"] == 0, judge_case(healthy_run, None)["lines"]
    case = run_case("mlp", "ramp", STEPS, ONSET, 1, seed)
    row = judge_case(case, healthy_run)
    assert row["before"] == 0 and row["first"].startswith(case.culprit), row


def test_a_nan_is_born_at_the_first_logged_step_from_the_onset_where_its_module_runs():
    """An expert routed no token at the onset's logged step is not called there: its NaN is born at the next logged
    step where it runs (that step is the case's onset), in each call of that step, and at no other."""

    lit = Lit(RECIPES["mlp"], "nan", onset=10, steps=40, seed=0, every=2)
    lit.train()
    out, at = torch.ones(2, 3), {"step": 0}
    lit._step = lambda: at["step"]  # the trainer's global step, without a trainer
    born = []
    for step in (9, 12, 15, 15, 17, 19):  # odd steps log (every 2); not called at 11 and 13 (not routed)
        at["step"] = step
        hurt = lit._hurt(lit.model, (), out)
        born.append(step if hurt is not None and torch.isnan(hurt).any() else None)
    assert born == [None, None, 15, 15, None, None] and lit.fired == 15
