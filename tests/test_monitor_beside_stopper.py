"""GradientMonitor beside GradientAnomalyStopping: one report of an anomalous step, the stopper's."""

import logging
import warnings

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_hooks.callbacks.gradients import GradientMonitor
from lightning_hooks.callbacks.stopping import GradientAnomalyStopping
from tests.grad_helpers import GradNet
from tests.helpers import events, loader, trainer


def fit_with(tmp_path, callbacks, caplog, max_steps=5, nan_steps=(2,)):
    """Fit GradNet with a NaN at ``nan_steps``; the reports read back from the event file, and the log records."""
    torch.manual_seed(0)
    logger = TensorBoardLogger(str(tmp_path), name="", version="")
    with caplog.at_level(logging.INFO, logger="lightning_hooks"):
        trainer(tmp_path, callbacks, logger=logger, max_steps=max_steps).fit(GradNet(nan_steps=nan_steps), loader())
    acc = events(str(tmp_path))
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("anomalies/report/text_summary")]
    records = [r for r in caplog.records if "Gradient anomaly" in r.getMessage()]
    return acc, texts, records


@pytest.mark.parametrize("monitor_first", [True, False])
def test_both_attached_one_nan_step_gives_one_report_the_stoppers_and_the_monitor_still_flags(
        tmp_path, caplog, monitor_first):
    monitor, stopper = GradientMonitor(log_every_n_steps=100), GradientAnomalyStopping(action="warn")
    acc, texts, records = fit_with(tmp_path, [monitor, stopper] if monitor_first else [stopper, monitor], caplog)
    (text,) = texts
    assert "Gradient anomaly at step 2" in text
    (record,) = records
    assert record.getMessage().startswith("GradientAnomalyStopping: training on.\nGradient anomaly at step 2")
    assert monitor.last_report is stopper.last_report and stopper.last_report.step == 2
    flags = {e.step: e.value for e in acc.Scalars("anomalies/nonfinite")}
    assert flags[2] == 1.0 and monitor.anomalous_steps == stopper.anomalous_steps == 3  # the NaN update poisons 3, 4


def test_the_monitor_alone_still_reports_in_the_event_file_and_logs_no_record(tmp_path, caplog):
    monitor = GradientMonitor(log_every_n_steps=100)
    _, texts, records = fit_with(tmp_path, [monitor], caplog)
    (text,) = texts
    assert "Gradient anomaly at step 2" in text and monitor.last_report.step == 2
    assert records == []


def test_the_stopper_alone_still_reports_in_the_event_file_and_in_one_record(tmp_path, caplog):
    stopper = GradientAnomalyStopping(action="warn")
    _, texts, records = fit_with(tmp_path, [stopper], caplog)
    assert len(texts) == 1 and "Gradient anomaly at step 2" in texts[0] and len(records) == 1


def test_detector_arguments_given_to_the_monitor_that_the_stopper_lacks_are_warned_about_at_setup(tmp_path):
    monitor = GradientMonitor(norm_threshold=10.0, provenance=True, window=50)
    stopper = GradientAnomalyStopping(action="warn", norm_threshold=1e3)
    with pytest.warns(UserWarning) as raised:
        trainer(tmp_path, [monitor, stopper], logger=False, max_steps=1).fit(GradNet(), loader())
    (message,) = [str(w.message) for w in raised if "in one Trainer" in str(w.message)]
    assert message.startswith("GradientMonitor(norm_threshold=10.0, provenance=True) and"
                              " GradientAnomalyStopping(norm_threshold=1000.0, provenance=False) are in one Trainer")
    assert "Pass the same values to GradientAnomalyStopping, or leave them out of GradientMonitor" in message


def test_a_monitor_left_at_its_defaults_or_agreeing_with_the_stopper_gets_no_warning(tmp_path):
    pairs = [(GradientMonitor(), GradientAnomalyStopping(norm_threshold=5.0, window=20)),
             (GradientMonitor(norm_threshold=5.0), GradientAnomalyStopping(norm_threshold=5.0))]
    for monitor, stopper in pairs:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            trainer(tmp_path, [monitor, stopper], logger=False, max_steps=1).fit(GradNet(), loader())
        assert not [w for w in raised if "in one Trainer" in str(w.message)]
