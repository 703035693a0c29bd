"""The Layers tab's data, without a server: flight records checked before drawing, colour scales anchored to bands."""

from __future__ import annotations

import json

from lightning_hooks.output._health_verdicts import Bands
from lightning_hooks.tensorboard_plugin.flight_records import parse_record
from lightning_hooks.tensorboard_plugin.run_data import Figure
from lightning_hooks.tensorboard_plugin.scales import HIGH_END, LOW_END, colour_scale
from lightning_hooks.tensorboard_plugin.verdicts import banner, judge

GOOD = {"step": 5, "steps": [4, 5], "losses": [1.0, "NaN"], "layers": ["a", "b"], "norms": [[1.0, 2.0], [1.0, None]],
        "usual": [[1.0, 1.5], None], "onsets": [["a", 5]], "leader": "a", "lead": 0}


def test_a_well_formed_record_passes_and_each_malformed_one_says_what_is_wrong():
    assert parse_record(json.dumps(GOOD)) == GOOD
    broken = {"layers": 3, "norms": [[1.0]], "losses": [1.0], "usual": [[1.0]], "onsets": [["a"]], "step": "5"}
    expected = {"layers": "`layers` is not a list of names", "norms": "`norms` is not one row",
                "losses": "`losses` is not one number a step", "usual": "`usual` is not one [norm, factor]",
                "onsets": "`onsets` is not a list of [layer, step]", "step": "`step` is not an integer"}
    for key, value in broken.items():
        assert expected[key] in parse_record(json.dumps({**GOOD, key: value})), key
    assert "missing keys ['norms']" in parse_record(json.dumps({k: v for k, v in GOOD.items() if k != "norms"}))
    assert "not JSON" in parse_record("{nope")
    assert "expected a JSON object, got list" in parse_record("[1, 2]")


def figure(kind: str, stat: str, values: list[list[float]]) -> Figure:
    return Figure(f"{kind}/{stat}", "", kind, stat, [f"l{i}" for i in range(len(values))], [0, 1], values)


def position(scale: dict, value: float) -> float:
    (x0, p0), *rest = scale["stops"]
    for x1, p1 in rest:
        if value <= x1:
            return p0 + (p1 - p0) * (value - x0) / (x1 - x0)
        x0, p0 = x1, p1
    return p0


def test_judged_figures_are_anchored_to_their_band_and_unjudged_ones_get_none():
    bands = Bands()
    zeros = colour_scale(figure("activations", "zero_fraction", [[1.5e-5, 0.0]]), bands)
    assert zeros["band"] == [None, 0.8] and position(zeros, 0.8) == HIGH_END
    assert position(zeros, 1.5e-5) < LOW_END + 0.001  # a speck of zeros stays dark, not bright yellow
    logit = colour_scale(figure("activations", "attention_max_logit", [[0.08, 0.58]]), bands)
    assert position(logit, 0.58) - position(logit, 0.08) < 0.01  # 0.08-0.58 against a band of 30: one colour
    entropy = colour_scale(figure("activations", "attention_entropy", [[3.280, 3.283]]), bands)
    assert abs(position(entropy, 3.283) - position(entropy, 3.280)) < 0.01
    assert colour_scale(figure("activations", "std", [[1.0, 2.0]]), bands) is None
    assert colour_scale(figure("gradients", "norm", [[1.0, 2.0]]), bands) is None  # judged per layer's history
    assert colour_scale(figure("updates", "log10_ratio", [[-3.0, -3.1]]), bands) is None  # against history and peers


def test_a_bad_batch_is_one_banner_line_for_every_layer_as_layerhealth_names_it():
    import numpy as np

    rng = np.random.default_rng(0)
    steps = list(range(0, 100, 2))  # judged from the 24th logged step on (Bands.min_points)
    level = 1.0 + 0.02 * rng.standard_normal((4, len(steps)))
    level[:, steps.index(70):] *= 30.0  # the batch goes bad: every layer's outputs x30 at once
    std = Figure("activations/std", "", "activations", "std", ["l0", "l1", "l2", "l3"], steps, level.tolist())
    lines = banner(judge([std], Bands()), Bands())
    assert [(b["layer"], b["verdict"], b["value"]) for b in lines] == [("(every layer)", "data", 4)]
    assert lines[0]["since"] == 70  # named at the bad batch's logged step
    assert lines[0]["layers"] == ["l0", "l1", "l2", "l3"] and lines[0]["problem"].startswith("every layer at once")
    jumped = level.copy()
    jumped[[0, 1, 3]] = 1.0 + 0.02 * rng.standard_normal((3, len(steps)))  # only l2 jumps: a layer, not the batch
    lines = banner(judge([Figure(**{**vars(std), "values": jumped.tolist()})], Bands()), Bands())
    assert [(b["layer"], b["verdict"]) for b in lines] == [("l2", "blowup")] and "layers" not in lines[0]
    assert lines[0]["order"] == list(Bands().titles()).index("blowup")
