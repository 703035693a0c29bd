"""The Layers tab's verdicts and row order, on figures built by hand."""

from __future__ import annotations

import math
import random

import pytest

from lightning_hooks.output._health_verdicts import JUDGED, Bands, Verdicts
from lightning_hooks.tensorboard_plugin.run_data import TAG, Figure, layer_order
from lightning_hooks.tensorboard_plugin.verdicts import bands_as_dict, bands_from_query, banner, judge


def figure(kind: str, stat: str, rows: dict[str, list[float | None]], steps: list[int] | None = None) -> Figure:
    width = len(next(iter(rows.values())))
    return Figure(f"{kind}/{stat}", "", kind, stat, list(rows), steps or list(range(0, 10 * width, 10)),
                  [list(v) for v in rows.values()])


DEFAULTS = Bands()


def marks(fig: Figure, bands: Bands = DEFAULTS, unjudged: frozenset[str] = frozenset()) -> set[tuple[str, int, str]]:
    return {(fig.rows[r], fig.steps[c], v) for r, c, v in judge(fig, bands, unjudged)}


def test_a_dead_relu_is_marked_and_a_half_zero_one_is_not():
    fig = figure("activations", "zero_fraction", {"net.1": [0.5, 0.52, 0.49], "net.3": [0.7, 0.85, 0.9]})
    assert marks(fig) == {("net.3", 10, "dead"), ("net.3", 20, "dead")}
    assert marks(fig, Bands(max_zero_fraction=0.95)) == set()
    assert marks(figure("val_activations", "zero_fraction", {"net.3": [0.9]})) == set()  # LayerHealth's figures only


def test_non_finite_counters_and_gradient_norms_are_marked_as_layer_health_names_them():
    fig = figure("activations", "nonfinite_fraction", {"a": [0.0, 0.25, math.nan, None]})
    assert marks(fig) == {("a", 10, "nonfinite"), ("a", 20, "nonfinite")}
    assert marks(figure("gradients", "norm", {"a": [1.0, math.inf], "b": [1.0, 1.0]})) == {("a", 10, "nonfinite_grad")}
    assert marks(figure("activations", "std", {"a": [math.nan]})) == set()  # not a judged figure


def test_update_ratios_outside_the_band_an_undefined_one_and_a_1d_row_are_not_judged():
    fig = figure("updates", "log10_ratio", {"slow": [-5.0, -3.9], "ok": [-3.0, -2.1], "fast": [-1.0, 0.3],
                                            "zero": [-math.inf, math.nan], "net.0.bias": [1.0, 1.0]})
    assert marks(fig, unjudged=frozenset({"net.0.bias"})) == {
        ("slow", 0, "too_slow"), ("fast", 0, "too_fast"), ("fast", 10, "too_fast")}
    band = Bands(update_ratio_band=(1e-5, 1e-1))
    assert marks(fig, band, frozenset({"net.0.bias"})) == {("fast", 10, "too_fast")}


def test_an_exploding_gradient_against_its_own_recent_history():
    norms = [1.0, 1.1, 0.9, 30.0, 1.0, 1.0]
    fig = figure("gradients", "norm", {"a": norms, "b": [100.0] * 6})  # b's size alone is no problem
    assert marks(fig) == {("a", 30, "exploding")}
    assert marks(figure("gradients", "norm", {"a": norms[1:]})) == set()  # two earlier points are not enough
    assert marks(fig, Bands(spike_factor=50)) == set()


def test_a_vanishing_gradient_against_the_largest_at_its_step():
    rows = {"big": [1.0, 1.0], "tiny": [1e-6, 1e-4], "zero": [0.0, None]}
    assert marks(figure("gradients", "norm", rows)) == {("tiny", 0, "vanishing"), ("zero", 0, "vanishing")}
    assert marks(figure("gradients", "norm", rows), Bands(spread_factor=1e7)) == {("zero", 0, "vanishing")}


def test_the_banner_says_since_when_a_layer_is_unhealthy_now():
    fig = figure("activations", "zero_fraction",
                 {"healed": [0.95, 0.95, 0.5, 0.5], "dead": [0.5, 0.95, 0.5, 0.9], "late": [0.9, 0.9, 0.9, None]})
    found = {(b["layer"], b["verdict"], b["since"]) for b in banner([(fig, judge(fig, DEFAULTS))], DEFAULTS)}
    # "dead" recovered once, so its current stretch began at step 30; "late" was not logged at the
    # last step, so its own last point counts.
    assert found == {("dead", "dead", 30), ("late", "dead", 0)}
    assert {b["problem"] for b in banner([(fig, judge(fig, DEFAULTS))], DEFAULTS)} == {
        "dead units: zero fraction of outputs above 0.8"}  # LayerHealth's heading


def test_a_healthy_run_has_an_empty_banner():
    fig = figure("activations", "zero_fraction", {"a": [0.5, 0.4]})
    assert banner([(fig, judge(fig, DEFAULTS))], DEFAULTS) == []


def test_on_the_same_figures_the_banner_and_layer_health_name_the_same_layers_problems_and_steps():
    """A synthetic run with every problem, some healed, fed to both: the same verdicts, the same "since"."""
    rng = random.Random(0)
    steps = list(range(0, 200, 10))
    grid: dict[tuple[str, str], dict[str, list[float]]] = {
        ("activations", "zero_fraction"): {f"l{i}": [rng.uniform(0.3, 0.95) for _ in steps] for i in range(6)},
        ("activations", "nonfinite_fraction"): {f"l{i}": [float(rng.random() < 0.2) for _ in steps] for i in range(6)},
        ("gradients", "norm"): {f"l{i}": [10 ** rng.uniform(-6, 1) for _ in steps] for i in range(6)},
        ("updates", "ratio"): {f"l{i}": [10 ** rng.uniform(-5.5, -1) for _ in steps] for i in range(6)},
    }
    grid[("gradients", "norm")]["l2"][12] = math.nan
    grid[("gradients", "norm")]["l5"][15:] = [1e-8] * 5  # vanishing at the end, since step 150
    verdicts = Verdicts(DEFAULTS)
    for col, step in enumerate(steps):
        for (kind, stat), rows in grid.items():
            verdicts.add(JUDGED[(kind, stat)], step, {name: values[col] for name, values in rows.items()})
    # The tab draws the update ratio as its log10 (the logged `log10_ratio`).
    grid[("updates", "log10_ratio")] = {name: [math.log10(v) for v in values]
                                        for name, values in grid.pop(("updates", "ratio")).items()}
    figures = [figure(kind, stat, rows, steps) for (kind, stat), rows in grid.items()]
    found = {(b["layer"], b["verdict"], b["since"]) for b in banner([(f, judge(f, DEFAULTS)) for f in figures],
                                                                     DEFAULTS)}
    expected = {(layer, problem, e.first) for (problem, layer), e in verdicts.episodes.items() if e.ongoing}
    assert found == expected
    assert {problem for _, problem, _ in found} >= {"dead", "nonfinite", "vanishing", "too_slow", "too_fast"}
    assert ("l5", "vanishing", 150) in found


def test_bands_from_query_parameters_are_layer_healths_and_it_validates_them():
    query = {"max_zero_fraction": "0.7", "window": "5", "update_ratio_low": "1e-5", "other": "x"}
    assert bands_from_query(query) == Bands(max_zero_fraction=0.7, window=5, update_ratio_band=(1e-5, 1e-2))
    assert bands_as_dict(Bands()) == {"max_zero_fraction": 0.8, "spike_factor": 10.0, "spread_factor": 1e5,
                                      "update_ratio_low": 1e-4, "update_ratio_high": 1e-2, "window": 20,
                                      "max_attention_logit": 30.0, "min_entropy_fraction": 0.1,
                                      "max_output_logit": 100.0, "max_massive_ratio": 1e4}
    assert bands_from_query(bands_as_dict(Bands(spike_factor=3.0))) == Bands(spike_factor=3.0)
    with pytest.raises(ValueError, match="`max_zero_fraction` must be a number, got 'lots'"):
        bands_from_query({"max_zero_fraction": "lots"})
    with pytest.raises(ValueError, match="`window` must be an int, got '2.5'"):
        bands_from_query({"window": "2.5"})
    with pytest.raises(ValueError, match=r"`spike_factor` must be a finite number > 1, got 0\.5"):
        bands_from_query({"spike_factor": "0.5"})
    with pytest.raises(ValueError, match=r"`update_ratio_band` must be \(low, high\) with 0 < low < high"):
        bands_from_query({"update_ratio_high": "1e-5"})


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
