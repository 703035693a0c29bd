"""Writing to loggers: scalars in one TensorBoard event per step, histograms to TensorBoard and W&B."""

import glob
import math
import warnings
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.plugins.custom_scalar import layout_pb2

from lightning_hooks import ActivationMonitor, GradientMonitor
from lightning_hooks.callbacks import _gradient_rows
from lightning_hooks.measure.aggregate import StatBlock
from lightning_hooks.output._histograms import log_histograms
from lightning_hooks.output.figures import HistogramBlock
from lightning_hooks.output.sinks import category_title, log_layout, log_scalars
from tests.helpers import TinyNet, csv_metrics, events, loader, trainer


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
    log_layout(SimpleNamespace(is_global_zero=False, loggers=[logger]), {"a": {"a": ["a"]}}, step=0)
    assert not glob.glob(f"{tmp_path}/**/events.out.tfevents.*", recursive=True)


def test_layouts_add_up_per_writer_and_each_addition_is_written_whole(tmp_path):
    first, second = TensorBoardLogger(tmp_path, name="a", version=0), TensorBoardLogger(tmp_path, name="b", version=0)
    log_layout(_trainer(first), {"activations": {"std": ["activations/.*/std$"]}}, step=3)
    log_layout(_trainer(first, second), {"gradients": {"norm": ["gradients/.*/norm$"]}, "empty": {}}, step=3)
    log_layout(_trainer(first), {"activations": {"std": ["activations/.*/std$"]}}, step=4)  # nothing new
    log_layout(_trainer(first), {"activations": {"mean": ["activations/.*/mean$"]}}, step=5)
    for logger in (first, second):
        logger.experiment.flush()
    got = {}
    for name in ("a", "b"):
        written = events(str(tmp_path / name)).Tensors("custom_scalars__config__")
        got[name] = [(e.step, [(c.title, [ch.title for ch in c.chart]) for c in
                               layout_pb2.Layout.FromString(e.tensor_proto.string_val[0]).category]) for e in written]
    assert got["a"] == [(3, [("activations: std", ["std"])]),
                        (3, [("activations: std", ["std"]), ("gradients: norm", ["norm"])]),
                        (5, [("activations: std, mean", ["std", "mean"]), ("gradients: norm", ["norm"])])]
    assert got["b"] == [(3, [("gradients: norm", ["norm"])])]


@pytest.mark.parametrize(
    ("charts", "title"),
    [
        (["mean by layer", "std by layer"], "activations: mean, std by layer"),
        (["norm by parameter", "total norm", "anomaly flags"], "grads: norm by parameter, total norm, anomaly flags"),
        (["std by layer", "norm by module", "max by layer"], "gradients: std by layer, norm by module, max by layer"),
    ],
)
def test_a_category_title_names_its_charts(charts, title):
    assert category_title(title.partition(":")[0], charts) == title


def test_pytorch_lightnings_tensorboard_logger_gets_the_layout_too(tmp_path):
    ptl_loggers = pytest.importorskip("pytorch_lightning.loggers")
    logger = ptl_loggers.TensorBoardLogger(tmp_path, name="", version=0, prefix="p")
    log_layout(_trainer(logger), {"activations": {"std by layer": ["activations/.*/std$"]}}, step=0)
    logger.experiment.flush()
    (event,) = events(logger.log_dir).Tensors("custom_scalars__config__")
    (category,) = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0]).category
    assert category.title == "p-activations: std by layer"
    assert list(category.chart[0].multiline.tag) == ["p\\-activations/.*/std$"]


class _FilteringLogger(TensorBoardLogger):
    def log_metrics(self, metrics, step=None):
        super().log_metrics({k: v for k, v in metrics.items() if not k.endswith("/std")}, step)


def test_a_logger_that_overrides_log_metrics_is_respected(tmp_path):
    logger = _FilteringLogger(tmp_path, name="", version=0)
    log_scalars(_trainer(logger), {"activations/fc/mean": 1.0, "activations/fc/std": 2.0}, step=0)
    logger.experiment.flush()
    assert _event_values(logger.log_dir) == [[("activations/fc/mean", 1.0)]]


def test_a_steps_histograms_go_to_tensorboard_in_one_event_read_back_exactly(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="", version=0)
    edges = [-2.0, -1.0, 0.0, 1.0, 2.0, 4.0]
    first = {"count_finite": 8, "min": -0.5, "max": 3.0, "sum": 4.0, "sum_sq": 12.0}
    second = {"count_finite": 3, "min": -1.5, "max": -1.5, "sum": -4.5, "sum_sq": 6.75}
    empty = {"count_finite": 0, "min": math.nan, "max": math.nan, "sum": 0.0, "sum_sq": 0.0}
    histograms = [("fc", first, [0, 1, 5, 0, 2]), ("out", second, [3, 0, 0, 0, 0]), ("dead", empty, [0] * 5)]
    log_histograms(_trainer(logger), HistogramBlock.of("a", histograms), edges, step=4)
    logger.experiment.flush()
    (path,) = glob.glob(f"{logger.log_dir}/events.out.tfevents.*")
    loaded = [Event.FromString(record) for record in RawEventFileLoader(path).Load()]
    assert [[v.tag for v in e.summary.value] for e in loaded if e.summary.value] == [["a/fc", "a/out"]]
    acc = events(logger.log_dir)
    (fc,) = acc.Histograms("a/fc")
    assert fc.step == 4
    assert (fc.histogram_value.min, fc.histogram_value.max, fc.histogram_value.num) == (-0.5, 3.0, 8)
    assert list(fc.histogram_value.bucket_limit) == [0.0, 1.0, 2.0, 4.0]  # right edges, trimmed
    assert list(fc.histogram_value.bucket) == [1, 5, 0, 2]
    assert list(acc.Histograms("a/out")[0].histogram_value.bucket) == [3]


def test_histograms_laid_out_from_arrays_are_the_messages_histogram_raw_makes_byte_for_byte():
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard.summary import histogram_raw

    from lightning_hooks.output._tensorboard_wire import histogram_summary, histogram_summary_bytes

    rng = np.random.default_rng(0)
    rows, bins = 300, 130  # 130 bins: a packed field over 127 doubles needs a two-byte length
    edges = [-math.inf, *np.sort(rng.normal(size=bins - 1)).tolist(), math.inf]
    counts = rng.integers(0, 5, (rows, bins)).astype(float)
    counts[:, :3], counts[5], counts[5, 7], counts[6, -1] = 0, 0, 3e9, 2  # trimmed bins, one bin, a large count
    figures = {k: rng.normal(size=rows) for k in ("min", "max", "sum", "sum_sq")}
    figures["count_finite"] = counts.sum(1)
    # proto3 leaves out 0.0 (not -0.0): a ReLU's min, a zero sum, every figure but the count at once
    figures["min"][3], figures["max"][4], figures["min"][7], figures["sum"][8] = -0.0, 0.0, 0.0, 0.0
    figures["min"][9] = figures["max"][9] = figures["sum"][9] = figures["sum_sq"][9] = 0.0
    spans = [(i, int(np.flatnonzero(c)[0]), int(np.flatnonzero(c)[-1]) + 1) for i, c in enumerate(counts)][1:]
    tags = [f"activations/net.{i}/é" for i in range(rows)]
    want = Summary(value=[v for i, a, b in spans for v in histogram_raw(
        tags[i], figures["min"][i], figures["max"][i], int(figures["count_finite"][i]), figures["sum"][i],
        figures["sum_sq"][i], edges[a + 1 : b + 1], [int(c) for c in counts[i, a:b]]).value])
    assert histogram_summary_bytes(tags, figures, counts, edges, spans) == want.SerializeToString()
    assert histogram_summary(tags, figures, counts, edges, spans) == want


def test_scalars_and_events_laid_out_as_bytes_are_what_protobuf_serializes():
    from tensorboard.compat.proto.summary_pb2 import Summary

    from lightning_hooks.output._tensorboard_wire import event_bytes, scalar_summary, scalar_summary_bytes

    values = [1.0, math.nan, 1e300, -3.5, 7, 0.1, True, 0.0, -0.0, 1e-50, False]  # in a oneof: 0.0 is written
    scalars = [f"s/{i}" for i in range(len(values))]
    want = Summary(value=[Summary.Value(tag=t, simple_value=float(v)) for t, v in zip(scalars, values)])
    assert scalar_summary_bytes(scalars, values) == want.SerializeToString()
    assert scalar_summary(scalars, values).SerializeToString() == want.SerializeToString()
    summary = want.SerializeToString()
    for step, wall_time in [(0, 1.7e9), (1, 1.7e9), (127, 0.0), (128, -0.0), (2**40, 3.25), (-1, 1.0)]:
        event = Event(summary=want, step=step, wall_time=wall_time)
        assert event_bytes(summary, step, wall_time) == event.SerializeToString(), step
    assert event_bytes(b"", 5, 1.0) == Event(summary=Summary(), step=5, wall_time=1.0).SerializeToString()


# ---------------------------------------------------------------- W&B (where wandb is installed)


@pytest.fixture
def wandb_logger(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from lightning.pytorch.loggers import WandbLogger

    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="lightning-hooks-tests")
    yield logger
    logger.experiment.finish()


def _wandb_histogram(logger, tag):
    """What the W&B run recorded for ``tag`` (its last value): bin counts and edges."""
    recorded = logger.experiment.summary._as_dict()[tag]
    assert recorded["_type"] == "histogram"
    return recorded["values"], recorded["bins"]


def test_histograms_go_to_wandb_trimmed_with_their_edges(wandb_logger):
    summary = {"count_finite": 8, "min": -0.5, "max": 3.0, "sum": 4.0, "sum_sq": 12.0}
    edges = [-2.0, -1.0, 0.0, 1.0, 2.0, 4.0]
    log_histograms(_trainer(wandb_logger), HistogramBlock.of("activations", [("fc", summary, [0, 1, 5, 0, 2])]),
                   edges, step=3)
    assert _wandb_histogram(wandb_logger, "activations/fc") == ([1, 5, 0, 2], [-1.0, 0.0, 1.0, 2.0, 4.0])


def test_more_bins_than_wandb_takes_are_merged_with_exact_counts(wandb_logger):
    n = 1000
    counts = [i % 7 + 1 for i in range(n)]
    edges = [float(i) for i in range(n + 1)]
    summary = {"count_finite": sum(counts), "min": 0.0, "max": float(n), "sum": 1.0, "sum_sq": 1.0}
    log_histograms(_trainer(wandb_logger), HistogramBlock.of("gradients", [("w", summary, counts)]), edges, step=0)
    values, bins = _wandb_histogram(wandb_logger, "gradients/w")
    assert len(values) == 500 and sum(values) == sum(counts)
    assert values[:2] == [counts[0] + counts[1], counts[2] + counts[3]]
    assert bins[0] == 0.0 and bins[1] == 2.0 and bins[-1] == float(n)


def test_monitors_send_their_histograms_to_wandb(tmp_path, wandb_logger):
    from lightning_hooks import ActivationMonitor, GradientMonitor

    torch.manual_seed(0)
    model = TinyNet()
    fit = trainer(tmp_path, [ActivationMonitor(), GradientMonitor()], logger=wandb_logger, max_steps=2)
    fit.fit(model, loader())
    values, bins = _wandb_histogram(wandb_logger, "activations/net.1")  # the ReLU, last logged step
    assert sum(values) == 8 * 16 and len(bins) == len(values) + 1
    values, _ = _wandb_histogram(wandb_logger, "gradients/net.0.weight")
    assert sum(values) == 16 * 8
    assert "activations/net.1/mean" in wandb_logger.experiment.summary._as_dict()


def _messages(record) -> list[str]:
    return [str(w.message) for w in record]


def test_histograms_no_logger_takes_are_announced_once_not_dropped_in_silence(tmp_path):
    csv = CSVLogger(tmp_path, name="csv")
    callbacks = [ActivationMonitor(log_every_n_steps=1), GradientMonitor(log_every_n_steps=1)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(tmp_path, callbacks, logger=csv, max_steps=3).fit(TinyNet(), loader())
    for owner in ("ActivationMonitor", "GradientMonitor"):
        assert _messages(record).count(
            f"{owner}: `histogram=True` but no logger takes histograms (the Trainer has CSVLogger): they are not"
            " written. Add a TensorBoardLogger or WandbLogger, or pass histogram=False.") == 1
    quiet = [ActivationMonitor(histogram=False), GradientMonitor(histogram=False)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(tmp_path, quiet, logger=CSVLogger(tmp_path, name="quiet"), max_steps=1).fit(TinyNet(), loader())
    assert not [m for m in _messages(record) if "histogram" in m]


def test_with_no_logger_the_monitors_say_so_once_and_compute_nothing_that_would_go_nowhere(tmp_path, monkeypatch):
    added, rows = Counter(), Counter()
    monkeypatch.setattr(StatBlock, "add_all", lambda self, *a, _f=StatBlock.add_all: (added.update([1]), _f(self, *a)))
    figures = _gradient_rows.row_figures
    monkeypatch.setattr(_gradient_rows, "row_figures", lambda *a: (rows.update([1]), figures(*a))[1])
    activations = ActivationMonitor(log_every_n_steps=1)
    monitor = GradientMonitor(log_every_n_steps=1, norm_threshold=1e-9)
    with pytest.warns(UserWarning) as record:
        trainer(tmp_path, [activations, monitor], logger=False, max_steps=3).fit(TinyNet(), loader())
    messages = _messages(record)
    assert messages.count("ActivationMonitor: the Trainer has no logger (logger=False), so its figures would be"
                          " written nowhere: it computes nothing. Give the Trainer a logger (e.g. TensorBoardLogger)"
                          " to see them.") == 1
    assert sum("GradientMonitor: the Trainer has no logger" in m and "the anomaly flags, reports and count still run"
               in m for m in messages) == 1
    assert not added and not rows
    assert monitor.anomalous_steps == 3  # what does not need a logger still works
    trainer(tmp_path, [ActivationMonitor(log_every_n_steps=1), GradientMonitor(log_every_n_steps=1)],
            logger=CSVLogger(tmp_path), max_steps=1).fit(TinyNet(), loader())
    assert added and rows  # the counters see work where there is a logger


def test_every_monitors_figures_of_a_logged_step_share_one_csv_row(tmp_path):
    torch.manual_seed(0)
    logger = CSVLogger(tmp_path, name="", version=0)
    trainer(tmp_path, [ActivationMonitor(), GradientMonitor()], logger=logger, max_steps=4).fit(TinyNet(), loader())
    rows = [row for row in csv_metrics(str(tmp_path)) if row["activations/net.0/mean"] or row["gradients/total_norm"]]
    assert [int(row["step"]) for row in rows] == [0, 1, 2, 3]
    assert all(row["activations/net.0/mean"] and row["gradients/total_norm"] for row in rows)


class LogsItsLoss(TinyNet):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_the_modules_own_self_log_values_are_lightnings_own_row_of_the_same_step(tmp_path):
    """As docs/how_it_works.md says: two rows a logged step, the package's first, mergeable by step."""
    torch.manual_seed(0)
    logger = CSVLogger(tmp_path, name="", version=0)
    trainer(tmp_path, [GradientMonitor()], logger=logger, max_steps=3).fit(LogsItsLoss(), loader())
    rows = [(int(row["step"]), bool(row["gradients/total_norm"]), bool(row["train_loss"]))
            for row in csv_metrics(str(tmp_path)) if row["gradients/total_norm"] or row["train_loss"]]
    assert rows == [(step, ours, not ours) for step in range(3) for ours in (True, False)]
