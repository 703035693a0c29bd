"""The Layers tab's verdicts and row order, on figures built by hand."""

from __future__ import annotations

import math

import pytest

from lightning_hooks.tensorboard_plugin.run_data import TAG, Figure, layer_order
from lightning_hooks.tensorboard_plugin.verdicts import Thresholds, banner, judge


def figure(kind: str, stat: str, rows: dict[str, list[float | None]], steps: list[int] | None = None) -> Figure:
    width = len(next(iter(rows.values())))
    return Figure(f"{kind}/{stat}", "", kind, stat, list(rows), steps or list(range(0, 10 * width, 10)),
                  [list(v) for v in rows.values()])


DEFAULTS = Thresholds()


def marks(fig: Figure, limits: Thresholds = DEFAULTS) -> set[tuple[str, int, str]]:
    return {(fig.rows[r], fig.steps[c], v) for r, c, v in judge(fig, limits)}


def test_a_dead_relu_is_marked_and_a_half_zero_one_is_not():
    fig = figure("activations", "zero_fraction", {"net.1": [0.5, 0.52, 0.49], "net.3": [0.7, 0.85, 0.9]})
    assert marks(fig) == {("net.3", 10, "dead"), ("net.3", 20, "dead")}
    assert marks(fig, Thresholds(dead_fraction=0.95)) == set()


def test_non_finite_values_and_counters_are_marked():
    fig = figure("activations", "std", {"a": [1.0, math.nan, math.inf, None]})
    assert marks(fig) == {("a", 10, "nonfinite"), ("a", 20, "nonfinite")}
    fig = figure("activations", "nonfinite_fraction", {"a": [0.0, 0.25]})
    assert marks(fig) == {("a", 10, "nonfinite")}


def test_update_ratios_far_from_one_in_a_thousand():
    fig = figure("updates", "log10_ratio", {"slow": [-5.0, -4.4], "ok": [-3.0, -2.0], "fast": [-1.0, 0.3]})
    assert marks(fig) == {("slow", 0, "too_slow"), ("fast", 0, "too_fast"), ("fast", 10, "too_fast")}


def test_an_exploding_gradient_against_its_own_history_needs_enough_history():
    norms = [1.0, 1.1, 0.9, 1.0, 1.05, 30.0]
    fig = figure("gradients", "norm", {"a": norms, "b": [1.0] * 6, "c": [1.0] * 6})
    assert marks(fig) == {("a", 50, "exploding")}
    assert marks(fig, Thresholds(min_history=6)) == set()  # five earlier points are not enough then


def test_gradients_against_their_neighbours():
    rows = {"l0": [1.0], "l1": [1.0], "big": [150.0], "l3": [1.0], "tiny": [0.001], "l5": [1.0]}
    assert marks(figure("gradients", "norm", rows)) == {("big", 0, "exploding"), ("tiny", 0, "vanishing")}
    assert marks(figure("gradients", "norm", {"alone": [1e-9]})) == {("alone", 0, "vanishing")}


def test_the_banner_says_since_when_a_layer_is_unhealthy_now():
    fig = figure("activations", "zero_fraction",
                 {"healed": [0.95, 0.95, 0.5, 0.5], "dead": [0.5, 0.95, 0.5, 0.9], "late": [0.9, 0.9, 0.9, None]})
    found = {(b["layer"], b["verdict"], b["since"]) for b in banner([(fig, judge(fig, Thresholds()))])}
    # "dead" recovered once, so its current stretch began at step 30; "late" was not logged at the
    # last step, so its own last point counts.
    assert found == {("dead", "dead", 30), ("late", "dead", 0)}


def test_a_healthy_run_has_an_empty_banner():
    fig = figure("activations", "zero_fraction", {"a": [0.5, 0.4]})
    assert banner([(fig, judge(fig, Thresholds()))]) == []


def test_thresholds_from_query_parameters():
    assert Thresholds.from_query({"dead_fraction": "0.7", "min_history": "2", "other": "x"}) == Thresholds(
        dead_fraction=0.7, min_history=2)
    with pytest.raises(ValueError, match="`dead_fraction` must be a float, got 'lots'"):
        Thresholds.from_query({"dead_fraction": "lots"})
    with pytest.raises(ValueError, match="`neighbours` must be a finite positive number, got '0'"):
        Thresholds.from_query({"neighbours": "0"})
    assert Thresholds.from_query({"update_target": "-2.5"}).update_target == -2.5


def test_layer_order_follows_the_recorded_forward_order():
    forward = ["decoder", "encoder.0", "encoder.1", "head"]  # registration order would say encoder first
    names = ["head", "encoder.1", "encoder.0.weight", "encoder.0.bias", "decoder", "extra"]
    assert layer_order(names, forward) == ["decoder", "encoder.0.bias", "encoder.0.weight", "encoder.1", "head",
                                           "extra"]
    assert layer_order(["encoder", "head"], ["encoder.0", "head"]) == ["encoder", "head"]  # a parent: its first child


def test_without_a_recorded_order_numbers_sort_as_numbers():
    assert layer_order(["net.10", "net.2", "net.1"], []) == ["net.1", "net.2", "net.10"]


@pytest.mark.parametrize("tag, parts", [
    ("activations/net.3/zero_fraction", ("", "activations", "net.3", "zero_fraction")),
    ("train-activations/net.3/std", ("train", "activations", "net.3", "std")),
    ("my-run-gradients/enc.0.weight/norm", ("my-run", "gradients", "enc.0.weight", "norm")),
    ("updates/net.0/log10_ratio", ("", "updates", "net.0", "log10_ratio")),
])
def test_tags_with_and_without_a_logger_prefix(tag, parts):
    found = TAG.match(tag)
    assert found is not None
    assert (found["prefix"] or "", found["kind"], found["name"], found["stat"]) == parts
