"""The flight recorder: which layer's gradient norm left its usual range first; written next to the logs."""

import csv
import math
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_hooks import GradientAnomalyStopping, SpikeTrigger
from lightning_hooks.callbacks._base import log_step
from lightning_hooks.callbacks._flight_recorder import FlightRecorder, analyse, layer_of
from tests.grad_helpers import GradNet
from tests.helpers import events, loader, trainer
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


def test_without_a_departure_nobody_is_named():
    record = analyse(139, STEPS, [1.0] * 40, series(10**6)[:, None], ["net.weight"])
    assert record.leader is None and record.onsets == () and "no layer" in record.summary()


def test_a_record_too_short_to_have_a_usual_range_says_so():
    record = analyse(139, STEPS[-6:], [1.0] * 6, series(130)[-6:, None], ["net.weight"])
    assert record.leader is None and "too few steps" in record.summary()


def test_parameters_are_grouped_by_module():
    assert layer_of("blocks.0.attn.in_proj_weight") == "blocks.0.attn" and layer_of("pos") == "pos"


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
    assert len(texts) == 1 and "net.0" in texts[0].tensor_proto.string_val[0].decode()


JUMP = 25  # the batch at which the second optimizer's gradient norm jumps


class TwoOptimizerNet(GradNet):
    """Manual optimization: ``net.0`` in one optimizer, the layers ``second`` in another; ``net.4`` x1000 at JUMP."""

    def __init__(self, second: tuple[int, ...]) -> None:
        super().__init__()
        self.automatic_optimization, self.second = False, second

    def on_fit_start(self) -> None:
        self.net[4].weight.register_hook(lambda g: g * 1000.0 if log_step(self.trainer) == JUMP else g)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        for optimizer in optimizers:
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        rest = [p for i in self.second for p in self.net[i].parameters()]
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.05), torch.optim.SGD(rest, lr=0.05)]


class SecondOptimizerNorms(L.Callback):
    """The gradient norm of each layer of the second optimizer, by log step."""

    def __init__(self) -> None:
        self.norms: dict[int, list[float]] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if optimizer is trainer.optimizers[1]:
            layers = [pl_module.net[i] for i in pl_module.second]
            self.norms[log_step(trainer)] = [math.sqrt(sum(p.grad.norm().item() ** 2 for p in layer.parameters()))
                                             for layer in layers]


@pytest.mark.parametrize("second", [(4,), (2, 4)], ids=["same-parameter-count", "other-parameter-count"])
def test_each_optimizer_has_its_own_record_and_the_acting_one_is_read(tmp_path, second):
    stopper = GradientAnomalyStopping(action="warn", spikes=SpikeTrigger(loss=None, window=32, warmup=16),
                                      flight_recorder=16, prog_bar=False)
    norms = SecondOptimizerNorms()
    L.seed_everything(0, verbose=False)
    run = trainer(tmp_path, [stopper, norms], max_steps=2 * (JUMP + 3), logger=False)
    run.fit(TwoOptimizerNet(second), loader(n=(JUMP + 3) * 8))
    report = stopper.last_report
    assert report.flags == ("grad_norm_spike",) and report.step == 2 * JUMP + 1  # the second optimizer's step
    record = report.flight_record
    assert record.step == JUMP and record.steps == tuple(range(JUMP - 15, JUMP + 1))  # log steps: one per batch
    assert record.layers == tuple(f"net.{i}" for i in second) and record.leader == "net.4"
    expected = [norms.norms[step] for step in record.steps]  # the second optimizer's, none of the first's
    assert np.allclose(record.norms, expected, rtol=1e-4)
    assert record.path.endswith(f"flight-record-step{JUMP}.csv")
