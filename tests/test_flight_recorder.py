"""The flight recorder: which layer's gradient norm left its usual range first (gradients only); written out."""

import csv
import json
import math

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_hooks import GradientAnomalyStopping
from lightning_hooks.callbacks._flight_recorder import FlightRecorder, analyse, record_json
from lightning_hooks.output._findings import owner_of
from tests.helpers import events
from tests.test_spikes import TRIGGER, RampNet, fit

STEPS = list(range(100, 140))  # 40 recorded steps; the anomaly at the last, 139


def series(rise_from: int, steady: float = 1.0) -> np.ndarray:
    """A norm wobbling by 5% around ``steady``, rising by half each step from step ``rise_from`` on."""
    wobble = 1 + 0.05 * np.sin(np.arange(len(STEPS)) * 1.7)
    rise = np.array([1.5 ** max(0, step - rise_from + 1) for step in STEPS])
    return steady * wobble * rise


def test_the_layer_whose_norm_left_its_range_first_leads_and_a_steady_one_is_not_named():
    norms = np.stack([series(10**6), series(130, 2.0), series(134), series(134)], 1)  # per parameter
    record = analyse(139, STEPS, [1.0] * 40, norms, ["steady.weight", "early.weight", "late.weight", "late.bias"])
    assert record.layers == ("steady", "early", "late")
    assert record.leader == "early" and record.lead == 9 and record.onsets == (("early", 130), ("late", 134))
    assert record.rise == pytest.approx(1.5**10 * (1 + 0.05 * math.sin(39 * 1.7)), rel=0.1)
    assert "layer 'early' left its usual gradient norm range first, 9 steps before (at step 130" in record.summary()


def test_a_slow_ramp_from_the_record_s_first_half_leads_against_its_range_from_before_it_began():
    """A ramp of 4% a step from step 110 would widen a range taken over the record's first half; a layer that
    fell to x0.6 at step 136 is not the leader."""
    ramp = np.array([1.04 ** max(0, step - 110) for step in STEPS]) * (1 + 0.02 * np.sin(np.arange(40) * 1.7))
    fell = series(10**6) * np.where(np.array(STEPS) >= 136, 0.6, 1.0)
    record = analyse(139, STEPS, [1.0] * 40, np.stack([fell, ramp], 1), ["fell.weight", "ramp.weight"])
    assert record.leader == "ramp" and 110 <= record.onsets[0][1] <= 124  # out by x1.5, its least band
    assert record.usual[1][0] == pytest.approx(1.0, rel=0.05)  # its range from before it began


def test_layers_that_leave_at_the_same_step_are_a_tie_in_registration_order_and_all_of_them_said_so():
    three = np.stack([series(130, 2.0), series(130), series(10**6)], 1)
    record = analyse(139, STEPS, [1.0] * 40, three, ["a.weight", "b.weight", "c.weight"])
    assert (record.leader, record.tied, record.every) == ("a", ("b",), False)
    assert "a tie, 2 layers left their usual gradient norm range at the same step 130" in record.summary()
    assert record_json(record)["tied"] == list(record.tied)
    every = np.stack([series(130), series(130, 2.0), series(130, 3.0)], 1)
    record = analyse(139, STEPS, [1.0] * 40, every, ["a.weight", "b.weight", "c.weight"])
    assert record.every and not record.data  # gradient norms alone cannot tell the batch from a layer
    assert "a tie, 3 layers left their usual gradient norm range at the same step 130" in record.summary()
    assert "every layer at once: the batch, or a fault whose gradient reaches them all" in record.summary()


def test_without_a_departure_nobody_is_named():
    record = analyse(139, STEPS, [1.0] * 40, series(10**6)[:, None], ["net.weight"])
    assert record.leader is None and record.onsets == () and "no layer" in record.summary()


def test_a_record_too_short_to_have_a_usual_range_says_so():
    record = analyse(139, STEPS[-6:], [1.0] * 6, series(130)[-6:, None], ["net.weight"])
    assert record.leader is None and "too few steps" in record.summary()


def test_parameters_are_grouped_by_module():
    assert owner_of("blocks.0.attn.in_proj_weight") == "blocks.0.attn" and owner_of("pos") == "pos"


def test_the_ring_keeps_the_last_steps_oldest_first_on_the_norms_device():
    recorder = FlightRecorder(3)
    for step in range(5):
        recorder.record(step, torch.tensor(float(step)), torch.tensor([step, 2.0 * step]))
    record = recorder.read(4, ["a.w", "b.w"])
    assert record.steps == (2, 3, 4) and record.losses == (2.0, 3.0, 4.0)
    assert record.norms == ((2.0, 4.0), (3.0, 6.0), (4.0, 8.0))
    assert recorder.read(4, ["only.one"]) is None  # the names do not fit the record


def test_the_record_is_written_as_csv_and_tensorboard_text(tmp_path):
    stopper = GradientAnomalyStopping(action="skip", spikes=TRIGGER, flight_recorder=16, prog_bar=False)
    fit(tmp_path, RampNet, stopper, logger=TensorBoardLogger(str(tmp_path), name="tb"))
    record = stopper.last_report.flight_record
    with open(record.path) as f:
        rows = list(csv.reader(f))
    assert rows[0][:3] == ["step", "loss", "grad_norm/net.0"] and len(rows) == 17
    assert [int(r[0]) for r in rows[1:]] == list(record.steps)
    texts = events(str(tmp_path / "tb")).Tensors("anomalies/flight_record/text_summary")
    assert len(texts) == 1
    lines = texts[0].tensor_proto.string_val[0].decode().splitlines()
    # Markdown for the Text tab: the summary, then a table of the layers, the leader's row first.
    assert lines[0].startswith("flight record of steps") and lines[2].startswith("| layer | left its range at step")
    leader, at = record.onsets[0]
    assert leader == "net.0" and lines[4].startswith(f"| net.0 | {at} | {record.step - at} | ")


def test_the_record_carries_each_layers_usual_range_and_its_json_for_the_layers_tab(tmp_path):
    norms = np.stack([series(10**6), series(130, 2.0)], 1)
    record = analyse(139, STEPS, [1.0] * 39 + [math.nan], norms, ["steady.weight", "early.weight"])
    (steady, factor), (early, _) = record.usual
    assert steady == pytest.approx(np.exp(np.median(np.log(series(10**6)[:20])))) and early == pytest.approx(2 * steady)
    assert factor == pytest.approx(1.5)  # a 5% wobble: the floor of the band
    data = record_json(record)
    assert data["leader"] == "early" and data["onsets"] == [["early", 130]] and data["losses"][-1] == "NaN"
    assert data["norms"][-1][1] == pytest.approx(record.norms[-1][1], rel=1e-5)
    stopper = GradientAnomalyStopping(action="skip", spikes=TRIGGER, flight_recorder=16, prog_bar=False)
    fit(tmp_path, RampNet, stopper, logger=TensorBoardLogger(str(tmp_path), name="tb"))
    written_events = events(str(tmp_path / "tb"))
    assert "anomalies/flight_record_data/text_summary" not in written_events.Tags()["tensors"]  # not in the Text tab
    (text,) = written_events.Tensors("anomalies/flight_record_data")
    assert written_events.SummaryMetadata("anomalies/flight_record_data").plugin_data.plugin_name == (
        "lightning_hooks_layers")
    written = json.loads(text.tensor_proto.string_val[0])
    assert written == json.loads(json.dumps(record_json(stopper.last_report.flight_record)))
    assert written["leader"] == "net.0" and len(written["usual"]) == len(written["layers"])
