"""The first module's step out: the batch's (every layer at once), or its own fault (docs/verdicts.md, "Culprit
and victims"): its outputs dead, or its own update ratio out while its gradient is not (its learning rate)."""

from __future__ import annotations

import math
import random

import pytest

from lightning_hooks.output._health_bands import Bands
from lightning_hooks.output._judge import Judge

CHAIN = ["stem", "attn", "mlp", "out"]
ONSET = 60


def run(scale: float, ratio: float, norm: float, dead: bool, seed: int) -> tuple[int, set[str]] | None:
    """Four modules, steady to 0.3%, their weights' gradient norms and update ratios steady to 5%.

    From ``ONSET`` every module's std is times ``scale`` (the stem's zeros where ``dead``), the stem's update
    ratio times ``ratio`` and its gradient norm times ``norm``. The first point a layer is named, and the layers.
    """
    rng = random.Random(seed)
    judge = Judge(Bands(), CHAIN)
    for i in range(ONSET + 6):
        out = i >= ONSET
        level = {row: (1 + d) * math.exp(rng.gauss(0, 0.003)) * (scale if out else 1.0) for d, row in enumerate(CHAIN)}
        grads = {f"{row}.weight": math.exp(rng.gauss(0, 0.05)) for row in CHAIN}
        ratios = {f"{row}.weight": 1e-3 * math.exp(rng.gauss(0, 0.05)) for row in CHAIN}
        figures = {"level": level, "norm": grads, "ratio": ratios, "zero_fraction": dict.fromkeys(CHAIN, 0.0)}
        if out:
            ratios["stem.weight"] *= ratio
            grads["stem.weight"] *= norm
            if dead:
                level["stem"], figures["zero_fraction"]["stem"] = 0.0, 1.0
        named = judge.step(figures, 2 * i).named
        if named:
            return i, {f.layer for f in named}
    return None


@pytest.mark.parametrize("ratio, norm", [(1.0, 1.0), (60.0, 60.0)])
def test_every_module_out_by_a_step_is_the_batch_also_where_the_stems_gradient_moved_its_update(ratio, norm):
    """Every module x5 at once: the batch, with the stem's update as it was, or x60 with its gradient (SGD)."""
    for seed in range(3):
        assert run(5.0, ratio, norm, False, seed) == (ONSET, {"(every layer)"}), seed


@pytest.mark.parametrize("scale", [1.6, 5.0])
def test_the_first_module_stepping_out_with_its_own_update_ratio_and_not_its_gradient_is_named(scale):
    """The stem's update ratio x60 while its gradient norm holds (its param group's LR x100), every module's std
    x1.6 or x5 from that step: its learning rate, not the batch; the stem is named at once."""
    for seed in range(3):
        found = run(scale, 60.0, 1.0, False, seed)
        assert found is not None and found[0] == ONSET and "stem" in found[1], (seed, found)
        assert "(every layer)" not in found[1], (seed, found)


def test_the_first_module_dead_is_named_dead_not_the_batch():
    """The stem's outputs all zeros from the onset, every module after it x0.01: its own dead units, named."""
    for seed in range(3):
        assert run(0.01, 1.0, 1.0, True, seed) == (ONSET, {"stem"}), seed
