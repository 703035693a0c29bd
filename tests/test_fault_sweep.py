"""The fault zoo's goals on cases the zoo does not hold: sweep cases that failed before the judge's peers rule.

Each case trains a small real model with the package's monitors and LayerHealth through the zoo's
own machinery (``benchmarks/fault_sweep.py``); the whole sweep is ``python benchmarks/fault_sweep.py``.
Before the judge compared a module's outputs with its same-kind peers before it, the BERT's keys
and queries, which grow 3x in every block as its attention sharpens, were named on a healthy run
(and hid the culprit's ramp), and the MLP logged every step named a Linear learning with the others.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fault_sweep import Variant, run_variant, verdict  # noqa: E402
from benchmarks.fault_zoo import judge_case  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("model, every, faults", [("bert", 2, ("ramp",)), ("mlp", 1, ("jump", "dead"))])
def test_a_recipe_whose_layers_learn_together_gets_no_verdict_and_its_culprit_is_named_first(model, every, faults):
    variant = Variant("test", model, ("healthy", *faults), every=every)
    healthy = run_variant(variant, "healthy")
    row = verdict(variant, judge_case(healthy, healthy), healthy.culprit)
    assert row["alarms"] == 0, row["lines"]
    for fault in faults:
        case = run_variant(variant, fault)
        row = verdict(variant, judge_case(case, healthy), case.culprit)
        assert row["culprit_first"] and row["before"] == 0, row
        if fault != "ramp":
            assert row["delay"] < every, row  # the first logged step after the onset
        else:
            assert row["delay"] is not None and (row["loss5"] is None or row["delay"] < row["loss5"]), row
