"""Who led, in a flight record: the first module in forward order whose outputs left their range, else gradients."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

from lightning_hooks import ActivationMonitor, GradientAnomalyStopping
from lightning_hooks.callbacks._flight_leader import OutputLevels, onset, output_levels
from lightning_hooks.callbacks._flight_recorder import analyse
from lightning_hooks.output.figures import ScalarBlock
from tests.grad_helpers import GradNet
from tests.helpers import loader, trainer
from tests.test_spikes import TRIGGER

STEPS = list(range(100, 140))  # 40 steps; the anomaly at the last, 139
MODULES = ("a", "b", "c", "d")  # forward order
NAMES = [f"{m}.weight" for m in MODULES]
WOBBLE = 1 + 0.05 * np.sin(np.arange(40) * 1.7)


def outputs(table: np.ndarray) -> OutputLevels:
    levels = OutputLevels(64)
    for step, row in zip(STEPS, table):
        levels.add(step, dict(zip(MODULES, row)))
    return levels


def steady() -> np.ndarray:
    return np.stack([WOBBLE * (i + 1) for i in range(len(MODULES))], 1)


def from_step(step: int, factor: float) -> np.ndarray:
    return np.where(np.array(STEPS) >= step, factor, 1.0)


def test_a_jump_is_led_by_the_first_module_out_in_forward_order_not_by_the_ones_after_it():
    table = steady()
    table[:, 1:] *= from_step(130, 20.0)[:, None]  # b jumps; c and d, after it, with it
    norms = steady() * from_step(130, 20.0)[:, None]  # every gradient norm with it: a tie of four
    record = analyse(139, STEPS, [1.0] * 40, norms, NAMES, outputs(table))
    assert (record.leader, record.judged_by, record.lead, record.data) == ("b", "outputs", 9, False)
    assert record.output_onsets == (("b", 130), ("c", 130), ("d", 130)) and record.tied == ()
    assert "layer 'b''s outputs left their usual range first in forward order, at step 130" in record.summary()
    alone = analyse(139, STEPS, [1.0] * 40, norms, NAMES)  # the same record from gradient norms alone
    assert (alone.leader, alone.tied, alone.judged_by, alone.every) == ("a", ("b", "c", "d"), "gradients", True)
    assert "every layer at once: the batch, or a fault whose gradient reaches them all" in alone.summary()


def test_a_ramp_is_led_by_its_module_though_a_faster_victim_after_it_crosses_its_range_first():
    ramp = np.array([1.04 ** max(0, step - 110) for step in STEPS])
    table = steady()
    table[:, 1] *= ramp
    table[:, 2] *= ramp * np.array([1.03 ** max(0, step - 110) for step in STEPS])  # c, after b, out sooner
    levels = outputs(table)
    (_, b), (_, c) = levels.departures()
    assert c.row < b.row
    record = analyse(139, STEPS, [1.0] * 40, steady(), NAMES, levels)
    assert record.leader == "b" and record.judged_by == "outputs"


def test_the_first_module_s_outputs_moving_is_the_batch():
    table = steady() * from_step(130, 30.0)[:, None]
    record = analyse(139, STEPS, [1.0] * 40, steady(), NAMES, outputs(table))
    assert record.data and record.leader == "a"
    assert "every layer at once, look at the batch" in record.summary()


def test_a_nan_is_led_by_the_module_it_was_born_in_though_every_module_is_nan_a_step_later():
    table = steady()
    table[30:, 1:] = math.nan  # born in b at step 130, through c and d at once
    table[31:, :] = math.nan  # then the weights: every module
    record = analyse(139, STEPS, [1.0] * 40, steady(), NAMES, outputs(table))
    assert (record.leader, record.lead, record.data) == ("b", 9, False)


def test_gradient_norms_alone_say_a_tie_in_registration_order_and_that_they_cannot_tell():
    norms = steady()
    norms[:, 1:3] *= from_step(130, 10.0)[:, None]
    record = analyse(139, STEPS, [1.0] * 40, norms, NAMES, outputs(steady()[:6]))  # 6 logged steps: too few
    assert (record.leader, record.tied, record.judged_by, record.data) == ("b", ("c",), "gradients", False)
    assert "a tie, 2 layers left their usual gradient norm range at the same step 130" in record.summary()
    assert "in forward order: 'b', 'c' (gradient norms alone cannot tell a cause" in record.summary()


def test_without_an_output_out_the_last_module_in_forward_order_whose_output_gradient_left_leads():
    grads = steady() * from_step(120, 0.1)[:, None]  # the loss's own move: every output gradient x0.1 at once
    grads[:, :3] *= from_step(130, 1e-6)[:, None]  # the gradient reaching c's output cut: a and b, before it, too
    levels = OutputLevels(64)
    for step, row, grad in zip(STEPS, steady(), grads):
        levels.add(step, dict(zip(MODULES, row)), dict(zip(MODULES, grad)))
    norms = steady() * from_step(130, 1e-3)[:, None]  # every gradient norm with it: a tie
    record = analyse(139, STEPS, [1.0] * 40, norms, NAMES, levels)
    assert (record.leader, record.judged_by, record.lead, record.tied, record.data) == (
        "c", "output gradients", 9, (), False)
    assert record.rise == pytest.approx(1e-6, rel=0.2) and record.output_onsets == ()
    assert "the gradient reaching layer 'c''s output left its usual range first in backward order" in record.summary()
    assert onset(grads[:, 3]).row == 20  # the loss side's own move at step 120: taken out, it leads nothing


def test_output_levels_are_read_from_activation_monitor_s_blocks_nan_where_an_output_was_not_finite():
    blocks = [ScalarBlock("activations", "std", ["a", "b"], [1.0, 2.0], ["activations/a/std", "activations/b/std"]),
              ScalarBlock("activations", "nan_count", ["a", "b"], [0.0, 3.0], ["", ""]),
              ScalarBlock("gradients", "norm", ["a.weight"], [5.0], [""])]
    levels = output_levels(blocks)
    assert levels["a"] == 1.0 and math.isnan(levels["b"]) and set(levels) == {"a", "b"}
    grads = [ScalarBlock("activation_grads", "std", ["a", "b"], [1e-3, 2e-3], ["", ""]), *blocks]
    assert output_levels(grads, "activation_grads") == {"a": 1e-3, "b": 2e-3}


class JumpNet(GradNet):
    """GradNet under Adam whose ``net.2`` outputs are x20 from step ``at`` on."""

    def __init__(self, at: int = 40) -> None:
        super().__init__(lr=1e-2, optimizer="adam")
        self.at = at
        self.net[2].register_forward_hook(self._jump)

    def _jump(self, module: nn.Module, args: Any, out: torch.Tensor) -> Any:
        return out * 20.0 if self.training and self.global_step >= self.at else None


@pytest.mark.parametrize("watched", [True, False])
def test_a_stopper_beside_an_activation_monitor_names_the_module_that_jumped(tmp_path, watched):
    stopper = GradientAnomalyStopping(action="warn", spikes=TRIGGER, flight_recorder=32, prog_bar=False)
    callbacks: list[L.Callback] = [stopper, *([ActivationMonitor(log_every_n_steps=1)] if watched else [])]
    L.seed_everything(0, verbose=False)
    trainer(tmp_path, callbacks, max_steps=45, logger=False).fit(JumpNet(), loader(45 * 8))
    record = stopper.last_report.flight_record
    assert stopper.last_report.step == 40
    if watched:
        assert (record.leader, record.judged_by, record.lead) == ("net.2", "outputs", 0)
        assert record.output_onsets[0] == ("net.2", 40)
    else:
        assert record.judged_by == "gradients" and not record.data
        assert "gradient norms alone cannot tell" in record.summary()


def test_only_the_outputs_within_the_record_s_steps_judge_not_a_first_layer_whose_level_moved_before():
    early = list(range(60, 100))
    learnt = np.stack([np.full(40, i + 1.0) for i in range(4)], 1) * WOBBLE[:, None]
    table = steady()
    table[:, 0] *= 3.0  # a's level moved 3x before the record began (a warm-up ended, a data mix changed), to stay
    table[:, 1:] *= from_step(130, 20.0)[:, None]
    levels = OutputLevels(128)
    for step, row in [*zip(early, learnt), *zip(STEPS, table)]:
        levels.add(step, dict(zip(MODULES, row)))
    (module, departure), *_ = levels.departures()  # over all 80 logged steps, the first module left its range
    assert module == "a" and levels.steps[departure.row] == 100
    record = analyse(139, STEPS, [1.0] * 40, steady(), NAMES, levels)
    assert (record.leader, record.data, record.judged_by) == ("b", False, "outputs")
