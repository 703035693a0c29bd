"""Typed figure records: the monitors emit them, the loggers get the same tags as before, listeners read fields."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth
from lightning_hooks.output.figures import FigureListener, HistogramBlock, ScalarBlock, as_metrics
from tests.helpers import TinyNet, events, loader, trainer


class Spy(FigureListener, L.Callback):
    """Keeps every record it is handed, by step."""

    def __init__(self) -> None:
        self.figures: dict[int, list[ScalarBlock]] = defaultdict(list)
        self.metrics: dict[int, dict[str, float]] = defaultdict(dict)
        self.histograms: dict[int, list[HistogramBlock]] = defaultdict(list)

    def record_figures(self, figures: Any, metrics: Any, step: int) -> None:
        self.figures[step] += figures
        self.metrics[step].update(metrics)

    def record_histograms(self, histograms: Any, edges: Any, step: int) -> None:
        self.histograms[step].append(histograms)


class TagsOnly(FigureListener, L.Callback):
    """A listener written against the tags (``record_scalars``) still gets every scalar."""

    def __init__(self) -> None:
        self.tags: set[str] = set()

    def record_scalars(self, metrics: Any, step: int) -> None:
        self.tags.update(metrics)


def test_records_name_kind_row_and_stat_and_carry_the_tags_the_loggers_get_unchanged(tmp_path):
    spy, tags_only = Spy(), TagsOnly()
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    monitors = [ActivationMonitor(stats=["mean", "std"]), GradientMonitor(stats=("norm", "max"), update_ratio=True)]
    trainer(tmp_path, [*monitors, spy, tags_only], logger=logger, max_steps=3).fit(TinyNet(), loader())
    logger.experiment.flush()
    blocks = [block for step in spy.figures.values() for block in step]
    # Counters logged only while not zero come as blocks too, empty on a healthy run.
    assert {(b.kind, b.stat) for b in blocks if b.rows} == {("activations", "mean"), ("activations", "std"),
                                                  ("gradients", "norm"), ("gradients", "max"),
                                                  ("updates", "ratio"), ("updates", "log10_ratio")}
    for block in blocks:
        assert list(block.tags) == [f"{block.kind}/{row}/{block.stat}" for row in block.rows]
        assert len(block.values) == len(block.rows)
    assert {r for b in blocks if b.kind == "activations" for r in b.rows} == {"net.0", "net.1", "net.2"}
    assert {r for b in blocks if b.kind == "gradients" for r in b.rows} == {
        "net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    # One record per statistic and step, however many rows: never one per row.
    for step, step_blocks in spy.figures.items():
        keys = [(b.kind, b.stat) for b in step_blocks]
        assert len(keys) == len(set(keys)), step
    for step, step_histograms in spy.histograms.items():
        assert sorted(h.kind for h in step_histograms) == ["activations", "gradients"], step
        for h in step_histograms:
            assert list(h.tags) == [f"{h.kind}/{row}" for row in h.rows] and h.counts.shape[0] == len(h.rows)
    # The loggers get exactly the tags the records carry, plus the scalars of no row.
    written = set(events(str(tmp_path / "tb")).Tags()["scalars"])
    from_records = {tag for step in spy.metrics.values() for tag in step}
    assert written == from_records == tags_only.tags
    assert {t for t in written if not any(t in b.tags for b in blocks)} == {"gradients/total_norm",
                                                                           "anomalies/nonfinite"}
    assert as_metrics(spy.figures[0], {})["activations/net.0/mean"] == spy.metrics[0]["activations/net.0/mean"]


def test_layer_health_reads_the_fields_so_a_renamed_tag_cannot_empty_it():
    health = LayerHealth()
    renamed = ["acts:net.1:zero_fraction", "acts:net.3:zero_fraction"]  # whatever the tags, the fields say it
    for step in range(3):
        health.record_figures([ScalarBlock("activations", "zero_fraction", ["net.1", "net.3"], [0.99, 0.1], renamed),
                               ScalarBlock("activations", "std", ["net.1", "net.3"], [0.01, 1.0], renamed)], {}, step)
    assert health.summary().splitlines()[:3] == ["Layer health at step 2: 1 layer unhealthy now",
                                                 "  dead units: zero fraction of outputs above 0.8",
                                                 "    net.1                    worst 0.99       since step 0"]
    assert health._latest[("activations", "std")] == {"net.1": 0.01, "net.3": 1.0}


def test_a_block_keeps_the_rows_where_the_mask_holds():
    block = ScalarBlock.where("gradients", "norm", ["a", "b", "c"], ["t/a", "t/b", "t/c"],
                              np.array([1.0, 2.0, 3.0]), np.array([True, False, True]))
    assert block == ("gradients", "norm", ["a", "c"], [1.0, 3.0], ["t/a", "t/c"])
    assert as_metrics([block], {"gradients/total_norm": 4.0}) == {"gradients/total_norm": 4.0, "t/a": 1.0, "t/c": 3.0}
