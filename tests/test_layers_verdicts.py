"""The Layers tab's verdicts and row order, on figures built by hand."""

from __future__ import annotations

import math
import random

import pytest

from lightning_hooks.output._health_verdicts import JUDGED, Bands, Verdicts
from lightning_hooks.output._judge import Judge
from lightning_hooks.tensorboard_plugin.run_data import TAG, Figure, layer_order
from lightning_hooks.tensorboard_plugin.verdicts import bands_as_dict, bands_from_query, banner, judge


def figure(kind: str, stat: str, rows: dict[str, list[float | None]], steps: list[int] | None = None) -> Figure:
    width = len(next(iter(rows.values())))
    return Figure(f"{kind}/{stat}", "", kind, stat, list(rows), steps or list(range(0, 10 * width, 10)),
                  [list(v) for v in rows.values()])


DEFAULTS = Bands()


def marks(*figs: Figure, bands: Bands = DEFAULTS, unjudged: frozenset[str] = frozenset()) -> set[tuple[str, int, str]]:
    return {(fig.rows[r], fig.steps[c], v) for fig, found in judge(list(figs), bands, unjudged).figures
            for r, c, v in found}


def test_a_dead_relu_is_marked_and_a_half_zero_one_is_not():
    fig = figure("activations", "zero_fraction", {"net.1": [0.5, 0.52, 0.49, 0.5], "net.3": [0.7, 0.85, 0.9, 0.9]})
    assert marks(fig) == {("net.3", 30, "dead")}  # most outputs zero: dead once it stays so for 3 logged points
    assert marks(fig, bands=Bands(max_zero_fraction=0.95)) == set()
    assert marks(figure("activations", "zero_fraction", {"net.3": [0.5, 0.995, 1.0]})) == {
        ("net.3", 10, "dead"), ("net.3", 20, "dead")}  # nearly all: at once
    assert marks(figure("val_activations", "zero_fraction", {"net.3": [0.9]})) == set()  # LayerHealth's figures only


def test_a_nan_is_marked_on_the_first_module_it_is_in_not_on_what_came_after_it():
    outputs = figure("activations", "nonfinite_fraction", {"a": [0.0, 0.0, None], "b": [0.0, 0.25, 1.0]})
    grads = figure("gradients", "norm", {"a.weight": [1.0, math.inf, 1.0], "b.weight": [1.0, math.nan, 1.0]})
    assert marks(outputs, grads) == {("b", 10, "nonfinite"), ("b.weight", 10, "nonfinite_grad"), ("b", 20, "nonfinite")}
    assert marks(figure("gradients", "norm", {"a.weight": [1.0, math.inf], "b.weight": [1.0, 1.0]})) == {
        ("a.weight", 10, "nonfinite_grad")}


def test_the_banner_says_since_when_a_layer_is_unhealthy_now():
    fig = figure("activations", "zero_fraction", {"healed": [1.0, 1.0, 0.5, 0.5, 0.5, 0.5],
                                                  "dead": [0.5, 0.5, 0.5, 1.0, 0.5, 0.995]})
    found = {(b["layer"], b["verdict"], b["since"]) for b in banner(judge([fig], DEFAULTS), DEFAULTS)}
    assert found == {("dead", "dead", 50)}  # it recovered once, so its current stretch began at step 50
    assert {b["problem"] for b in banner(judge([fig], DEFAULTS), DEFAULTS)} == {
        "dead units: zero fraction of outputs above 0.8"}  # LayerHealth's heading
    late = figure("activations", "zero_fraction", {"late": [1.0, 1.0, 1.0, None]})
    # Not logged at the last step: its own last point counts.
    assert {(b["layer"], b["since"]) for b in banner(judge([late], DEFAULTS), DEFAULTS)} == {("late", 0)}


def test_the_banner_counts_a_row_as_the_module_the_judge_says_it_belongs_to():
    outputs = figure("activations", "nonfinite_fraction", {"net.0": [0.0, 0.0], "net.1": [0.0, 0.5]})
    weights = figure("gradients", "norm", {"net.0.weight": [1.0, 1.0], "net.1.weight": [1.0, math.nan]})
    found = {(b["layer"], b["module"]) for b in banner(judge([outputs, weights], DEFAULTS), DEFAULTS)}
    assert found == {("net.1", "net.1"), ("net.1.weight", "net.1")}  # one layer: its output and its weight's gradient
    by_module = figure("gradients", "norm", {"net.0": [1.0, 1.0], "net.1": [1.0, math.nan]})  # granularity="module"
    lines = banner(judge([by_module], DEFAULTS, order=["net.0", "net.1"]), DEFAULTS)
    assert [(b["layer"], b["module"]) for b in lines] == [("net.1", "net.1")]  # in the recorded forward order: a module


def test_a_healthy_run_has_an_empty_banner():
    fig = figure("activations", "zero_fraction", {"a": [0.5, 0.4]})
    assert banner(judge([fig], DEFAULTS), DEFAULTS) == []


def test_on_the_same_figures_the_banner_and_layer_health_name_the_same_layers_problems_and_steps():
    """A synthetic run, a layer jumping and a dead one and a NaN later, fed to both: the same verdicts, "since"."""
    rng = random.Random(0)
    steps = list(range(0, 600, 10))
    names = [f"l{i}" for i in range(6)]
    grid: dict[tuple[str, str], dict[str, list[float]]] = {
        ("activations", "std"): {n: [(1 + i) * math.exp(rng.gauss(0, 0.03)) * (20 if i >= 2 and s >= 400 else 1)
                                     for s in steps] for i, n in enumerate(names)},
        ("activations", "zero_fraction"): {n: [0.95 if n == "l4" and s >= 500 else rng.uniform(0.3, 0.6)
                                               for s in steps] for n in names},
        ("activations", "nonfinite_fraction"): {n: [float(n == "l5" and s == 550) for s in steps] for n in names},
        ("gradients", "norm"): {f"{n}.weight": [(1 + i) * math.exp(rng.gauss(0, 0.2)) for _ in steps]
                                for i, n in enumerate(names)},
        ("updates", "ratio"): {f"{n}.weight": [1e-3 * math.exp(rng.gauss(0, 0.05)) for _ in steps] for n in names},
    }
    verdicts = Verdicts(DEFAULTS)
    for col, step in enumerate(steps):
        for (kind, stat), rows in grid.items():
            verdicts.add(JUDGED[(kind, stat)], step, {name: values[col] for name, values in rows.items()})
    # The tab draws the update ratio as its log10 (the logged `log10_ratio`).
    grid[("updates", "log10_ratio")] = {name: [math.log10(v) for v in values]
                                        for name, values in grid.pop(("updates", "ratio")).items()}
    figures = [figure(kind, stat, rows, steps) for (kind, stat), rows in grid.items()]
    found = {(b["layer"], b["verdict"], b["since"]) for b in banner(judge(figures, DEFAULTS), DEFAULTS)}
    expected = {(layer, problem, e.first) for (problem, layer), e in verdicts.episodes.items() if e.ongoing}
    assert found == expected
    assert ("l2", "blowup", 400) in found and not {layer for layer, _, _ in found} & {"l3", "l4", "l5"}


def test_bands_from_query_parameters_are_layer_healths_and_it_validates_them():
    query = {"max_zero_fraction": "0.7", "window": "25", "norm_factor": "3", "other": "x"}
    assert bands_from_query(query) == Bands(max_zero_fraction=0.7, window=25, norm_factor=3.0)
    assert bands_as_dict(Bands()) == {"max_zero_fraction": 0.8, "level_factor": 1.25, "norm_factor": 4.0,
                                      "ratio_factor": 4.0, "cusum": 5.0, "window": 32, "min_points": 24,
                                      "max_attention_logit": 30.0, "min_entropy_fraction": 0.1,
                                      "max_output_logit": 100.0, "max_massive_ratio": 1e4, "output_grad_factor": 4.0}
    assert bands_from_query(bands_as_dict(Bands(level_factor=3.0))) == Bands(level_factor=3.0)
    with pytest.raises(ValueError, match="`max_zero_fraction` must be a number, got 'lots'"):
        bands_from_query({"max_zero_fraction": "lots"})
    with pytest.raises(ValueError, match="`window` must be an int, got '2.5'"):
        bands_from_query({"window": "2.5"})
    with pytest.raises(ValueError, match=r"`norm_factor` must be a finite number > 1, got 0\.5"):
        bands_from_query({"norm_factor": "0.5"})
    with pytest.raises(ValueError, match=r"`min_points` must be at most `window` \(32\), got 40"):
        bands_from_query({"min_points": "40"})


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


def test_every_problem_has_a_mark_colour_in_the_tab() -> None:
    """The heatmap outlines each problem's cells in its colour: a problem missing from the map was drawn black,
    the colour of NaN (as TransformerStability's four were)."""
    import re
    from pathlib import Path

    from lightning_hooks.output._health_bands import PROBLEMS

    script = (Path(__file__).resolve().parent.parent / "lightning_hooks" / "tensorboard_plugin" / "static"
              / "heatmap.js").read_text()
    colours = re.search(r"export const MARK_COLOURS = \{(.*?)\};", script, re.S)[1]
    assert set(re.findall(r"(\w+):", colours)) == set(PROBLEMS)


def test_logged_every_step_a_layer_learning_fast_in_the_first_steps_is_named_by_neither_the_tab_nor_layer_health():
    """Logged every step, the rows' ranges judge from 48 steps on (2 x ``min_points``), as logged every 2: a layer
    whose outputs grow x1.8 over steps 26-46 (a small model's fastest learning) is history, in both."""
    rng = random.Random(0)
    steps = list(range(120))
    rise = [math.exp(0.6 * min(1.0, max(0.0, (s - 26) / 20))) for s in steps]
    levels = {f"l{i}": [(1 + i) * math.exp(rng.gauss(0, 0.03)) * (rise[s] if i == 3 else 1) for s in steps]
              for i in range(6)}
    verdicts, judge_without_steps, named_without = Verdicts(DEFAULTS), Judge(DEFAULTS), set()
    for col, step in enumerate(steps):
        verdicts.add("level", step, {name: values[col] for name, values in levels.items()})
        named_without |= {f.layer for f in judge_without_steps.step({"level": {n: v[col] for n, v in levels.items()}})
                          .named}
    assert named_without == {"l3"}  # judged from its 24th point on, as it did before the warm-up in steps
    assert verdicts.episodes == {}
    assert marks(figure("activations", "std", levels, steps)) == set()
