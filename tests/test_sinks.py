"""Writing to loggers: scalars in one TensorBoard event per step, read back from the event file."""

import glob
import math
from types import SimpleNamespace

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event

from lightning_hooks.sinks import log_scalars
from tests.helpers import events


def _trainer(*loggers):
    return SimpleNamespace(is_global_zero=True, loggers=list(loggers))


def _event_values(log_dir):
    (path,) = glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)
    loaded = (Event.FromString(record) for record in RawEventFileLoader(path).Load())
    return [[(v.tag, v.simple_value) for v in e.summary.value] for e in loaded if e.summary.value]


def test_a_steps_scalars_go_to_tensorboard_in_one_event(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="", version=0)
    metrics = {"activations/fc/mean": 0.25, "activations/fc/std": 2.0, "activations/fc/max": math.inf}
    log_scalars(_trainer(logger), metrics, step=7)
    log_scalars(_trainer(logger), {"activations/fc/mean": -1.5}, step=8)
    logger.experiment.flush()
    assert _event_values(logger.log_dir) == [list(metrics.items()), [("activations/fc/mean", -1.5)]]
    acc = events(logger.log_dir)
    assert [(s.step, s.value) for s in acc.Scalars("activations/fc/mean")] == [(7, 0.25), (8, -1.5)]
    assert acc.Scalars("activations/fc/max")[0].value == math.inf


def test_prefixed_tensorboard_and_other_loggers_get_log_metrics(tmp_path):
    tb = TensorBoardLogger(tmp_path / "tb", name="", version=0, prefix="run1")
    csv = CSVLogger(tmp_path / "csv", name="", version=0)
    log_scalars(_trainer(tb, csv), {"gradients/total_norm": 3.0}, step=2)
    tb.experiment.flush()
    csv.save()
    assert events(tb.log_dir).Scalars("run1-gradients/total_norm")[0].value == 3.0
    assert "gradients/total_norm" in (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()


def test_nothing_is_written_off_rank_zero(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="", version=0)
    log_scalars(SimpleNamespace(is_global_zero=False, loggers=[logger]), {"a": 1.0}, step=0)
    assert not glob.glob(f"{tmp_path}/**/events.out.tfevents.*", recursive=True)


class _FilteringLogger(TensorBoardLogger):
    def log_metrics(self, metrics, step=None):
        super().log_metrics({k: v for k, v in metrics.items() if not k.endswith("/std")}, step)


def test_a_logger_that_overrides_log_metrics_is_respected(tmp_path):
    logger = _FilteringLogger(tmp_path, name="", version=0)
    log_scalars(_trainer(logger), {"activations/fc/mean": 1.0, "activations/fc/std": 2.0}, step=0)
    logger.experiment.flush()
    assert _event_values(logger.log_dir) == [[("activations/fc/mean", 1.0)]]
