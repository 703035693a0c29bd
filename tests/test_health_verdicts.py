"""LayerHealth's verdicts: values outside documented bands are flagged, ordinary ones are not, since when."""

import math

from lightning_hooks.output._health_verdicts import Bands, Verdicts, judge, judge_norm, judge_ratio


def test_ordinary_norms_small_or_large_are_not_flagged_but_a_jump_against_the_layers_own_history_is():
    verdicts = Verdicts(Bands())
    for step in range(5):  # 0.08 and 42.9 are just two layers' sizes
        verdicts.add("norm", step, {"net.0": 0.08, "net.6": 42.9})
    assert verdicts.summary(top_k=3) == ("Layer health at step 4: healthy (every layer inside the bands;"
                                         " see LayerHealth's docstring).")
    verdicts.add("norm", 5, {"net.0": 0.08, "net.6": 429.1 + 1})  # > 10x its own median
    verdicts.add("norm", 6, {"net.0": 0.08, "net.6": 43.0})
    assert verdicts.summary(top_k=3).splitlines() == [
        "Layer health at step 6: healthy now",
        "  earlier, healthy since:",
        "    net.6                    exploding gradients, steps 5-5 (worst 430.1)",
    ]


def test_vanishing_is_judged_against_the_neighbours_and_non_finite_norms_are_their_own_problem():
    verdicts = Verdicts(Bands(spread_factor=1e4))
    verdicts.add("norm", 0, {"net.0": 1e-7, "net.2": 1e-2, "net.4": 1.0, "net.6": math.nan})
    verdicts.add("norm", 1, {"net.0": 1e-9, "net.2": 1e-2, "net.4": 1.0, "net.6": math.inf})
    assert verdicts.summary(top_k=3).splitlines() == [
        "Layer health at step 1: 2 layers unhealthy now",
        "  non-finite gradients",
        "    net.6                    worst nan        since step 0",
        "  vanishing gradients: norm below the largest layer's / 10000",
        "    net.0                    worst 1e-09      since step 0",
    ]


def test_update_ratios_far_from_1e3_are_flagged_an_undefined_one_is_not_and_the_list_is_capped():
    verdicts = Verdicts(Bands(update_ratio_band=(1e-4, 1e-2)))
    ratios = {"a": 1e-3, "b": 5e-3, "zero_init": math.inf, **{f"fast{i}": 0.5 for i in range(4)}, "slow": 1e-6}
    verdicts.add("ratio", 3, ratios)
    assert verdicts.summary(top_k=2).splitlines() == [
        "Layer health at step 3: 5 layers unhealthy now",
        "  learning too fast: update ratio above 0.01",
        "    fast0                    worst 0.5        since step 3",
        "    fast1                    worst 0.5        since step 3",
        "    ... and 2 more",
        "  learning too slowly: update ratio below 0.0001",
        "    slow                     worst 1e-06      since step 3",
    ]


def test_problems_are_listed_by_kind_then_by_when_they_began_then_by_depth():
    verdicts = Verdicts(Bands())
    verdicts.add("zero_fraction", 0, {"net.1": 0.5, "net.3": 0.9, "net.5": 0.5})
    verdicts.add("zero_fraction", 5, {"net.1": 0.5, "net.3": 0.9, "net.5": 0.95})
    verdicts.add("nonfinite", 5, {"net.5": 0.25})
    lines = verdicts.summary(top_k=5).splitlines()
    assert lines[1:] == [
        "  non-finite outputs",
        "    net.5                    worst 0.25       since step 5",
        "  dead units: zero fraction of outputs above 0.8",
        "    net.3                    worst 0.9        since step 0",  # the first to die comes first
        "    net.5                    worst 0.95       since step 5",
    ]


def test_the_norm_rule_keeps_window_recent_norms_and_is_one_function_for_layer_health_and_the_tab():
    norms = [1.0, 1.0, 1.0, 20.0, 20.0, 20.0]

    def exploding(bands: Bands) -> list[int]:
        history: dict = {}
        return [step for step, norm in enumerate(norms) if judge("norm", {"a": norm}, bands, history)]

    assert exploding(Bands(window=3)) == [3, 4]  # by step 5 its last 3 norms are 1, 20, 20: median 20
    assert exploding(Bands()) == [3, 4, 5]  # its last 20: median 1 still
    assert judge_norm({"a": 20.0}, Bands(), {"a": [1.0, 1.0]}) == {}  # fewer than 3 earlier norms
    assert judge_ratio({"a": 5e-5, "b": 1e-3, "c": 0.0}, Bands()) == {"a": "too_slow"}
