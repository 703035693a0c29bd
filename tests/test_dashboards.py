"""What a big model's dashboard holds: the default stats, figures that are zero by construction only
where they say something, one Custom Scalars layout per run shared by every callback, charts only
once they have data, and a guard on size."""

from __future__ import annotations

import math
import re
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn

from lightning_hooks import DEFAULT_STATS, DIVERGENCE_STATS, STAT_NAMES, ActivationMonitor, GradientMonitor
from tests.helpers import TinyNet, events, forward_hook_count, loader, trainer
from tests.zoo import tb_scalars

LAYOUT_TAG = "custom_scalars__config__"


def layouts(log_dir: Any) -> list[tuple[int, dict[str, dict[str, list[str]]]]]:
    """Every Custom Scalars layout written under ``log_dir``, in order, as (step, {category: {chart: regexes}})."""
    acc = events(str(log_dir))
    if LAYOUT_TAG not in acc.Tags()["tensors"]:
        return []
    out = []
    for event in acc.Tensors(LAYOUT_TAG):
        layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
        out.append((event.step, {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart}
                                 for c in layout.category}))
    return out


def test_the_default_logs_no_chart_flat_by_construction_and_stats_asked_for_are_logged_every_step(tmp_path):
    assert DEFAULT_STATS == ("mean", "std", "abs_max", "zero_fraction", "nonfinite_fraction")
    assert set(DEFAULT_STATS) | set(DIVERGENCE_STATS) <= set(STAT_NAMES)
    moments = {f"activations/net.{i}/{s}" for i in range(3) for s in ("mean", "std", "abs_max")}
    for name, monitor, expected in (
        # Linear outputs are never exactly 0 and a healthy run has no NaN: only the ReLU's zero_fraction.
        ("default", ActivationMonitor(), moments | {"activations/net.1/zero_fraction"}),
        ("five", ActivationMonitor(stats=DEFAULT_STATS),
         {f"activations/net.{i}/{s}" for i in range(3) for s in DEFAULT_STATS}),
        ("all", ActivationMonitor(stats=STAT_NAMES),
         {f"activations/net.{i}/{s}" for i in range(3) for s in STAT_NAMES}),
    ):
        logger = TensorBoardLogger(tmp_path, name=name, version=0)
        trainer(tmp_path, [monitor], logger=logger, max_steps=2).fit(TinyNet(), loader())
        acc = events(str(tmp_path / name))
        assert set(acc.Tags()["scalars"]) == expected, name
        assert all(len(acc.Scalars(tag)) == 2 for tag in expected), name  # at every logged step


class _Probed(TinyNet):
    """TinyNet with a probe the loss never sees: it gets 2 NaNs at step 1, one +Inf and one 0 at step 2."""

    def __init__(self) -> None:
        super().__init__()
        self.probe = nn.Identity()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        seen = batch[0].clone()
        if self.global_step == 1:
            seen[0, :2] = math.nan
        if self.global_step == 2:
            seen[3, 5] = math.inf
            seen[4, 4] = 0.0
        self.probe(seen)
        return super().training_step(batch, batch_idx)


def test_divergence_counters_are_logged_while_not_zero_and_once_more_at_zero(tmp_path):
    monitor = ActivationMonitor(log_every_n_steps=1, modules=["net.0", "probe"])
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer(tmp_path, [monitor], logger=logger, max_steps=5).fit(_Probed(), loader())
    acc = events(str(tmp_path))
    counters = sorted(t for t in acc.Tags()["scalars"] if t.rsplit("/", 1)[1] in DIVERGENCE_STATS)
    assert counters == ["activations/probe/nan_count", "activations/probe/posinf_count"]
    assert tb_scalars(acc, "activations/probe/nan_count") == {1: 2, 2: 0}
    assert tb_scalars(acc, "activations/probe/posinf_count") == {2: 1, 3: 0}
    # nonfinite_fraction like the counters; zero_fraction from the first zero on, at every logged step.
    assert tb_scalars(acc, "activations/probe/nonfinite_fraction") == {1: 2 / 64, 2: 1 / 64, 3: 0}
    assert tb_scalars(acc, "activations/probe/zero_fraction") == {2: 1 / 64, 3: 0, 4: 0}
    assert "activations/net.0/nonfinite_fraction" not in acc.Tags()["scalars"]
    assert "activations/net.0/zero_fraction" not in acc.Tags()["scalars"]
    # The layout: zero_fraction's chart once the ReLU's zeros are logged (step 0), the non-finite
    # charts once a non-finite value is (step 1); each addition rewrites the layout.
    written = [(step, {title: list(charts) for title, charts in layout.items()}) for step, layout in layouts(tmp_path)]
    assert written == [
        (0, {"activations: mean, std, abs_max by layer": ["mean by layer", "std by layer", "abs_max by layer"]}),
        (1, {"activations: mean, std, abs_max by layer": ["mean by layer", "std by layer", "abs_max by layer"],
             "activations, non-finite: nonfinite_fraction, non-finite counts by layer":
                 ["nonfinite_fraction by layer", "non-finite counts by layer"]}),
        (2, {"activations: mean, std, abs_max, zero_fraction by layer":
                 ["mean by layer", "std by layer", "abs_max by layer", "zero_fraction by layer"],
             "activations, non-finite: nonfinite_fraction, non-finite counts by layer":
                 ["nonfinite_fraction by layer", "non-finite counts by layer"]}),
    ]


def test_counters_asked_for_are_logged_at_every_logged_step(tmp_path):
    monitor = ActivationMonitor(log_every_n_steps=1, modules="probe", stats=["mean", "nan_count"])
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer(tmp_path, [monitor], logger=logger, max_steps=4).fit(_Probed(), loader())
    acc = events(str(tmp_path))
    assert tb_scalars(acc, "activations/probe/nan_count") == {0: 0, 1: 2, 2: 0, 3: 0}
    assert tb_scalars(acc, "activations/probe/posinf_count") == {2: 1, 3: 0}


def test_one_layout_per_run_draws_every_scalar_and_holds_every_callbacks_charts(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    callbacks = [ActivationMonitor(log_every_n_steps=1), GradientMonitor(log_every_n_steps=1),
                 ActivationMonitor(log_every_n_steps=1, modules="net.0", stats=["max"])]
    trainer(tmp_path, callbacks, logger=logger, max_steps=2).fit(TinyNet(), loader())
    trainer(tmp_path, callbacks, logger=logger, max_steps=3).fit(TinyNet(), loader())  # adds nothing
    # One write per callback that added a chart at fit start, one when the ReLU's zero_fraction came
    # (step 0); the second fit added none. Each title names its charts.
    written = [layout for _, layout in layouts(tmp_path)]
    assert [list(layout) for layout in written] == [
        ["activations: mean, std, abs_max by layer"],
        ["activations: mean, std, abs_max by layer", "gradients: norm by parameter, total norm, anomaly flags"],
        ["activations: mean, std, abs_max, max by layer", "gradients: norm by parameter, total norm, anomaly flags"],
        ["activations: mean, std, abs_max, max, zero_fraction by layer",
         "gradients: norm by parameter, total norm, anomaly flags"],
    ]
    last = dict(zip(("activations", "gradients"), written[-1].values()))
    assert list(last["activations"]) == ["mean by layer", "std by layer", "abs_max by layer", "max by layer",
                                         "zero_fraction by layer"]
    assert list(last["gradients"]) == ["norm by parameter", "total norm", "anomaly flags"]
    tags = events(str(tmp_path)).Tags()["scalars"]
    drawn = {chart: [t for t in tags if any(re.match(r, t) for r in regexes)]
             for charts in last.values() for chart, regexes in charts.items()}
    assert set(tags) == {t for matched in drawn.values() for t in matched}  # every scalar is in a chart
    assert drawn["std by layer"] == [f"activations/net.{i}/std" for i in range(3)]
    assert drawn["max by layer"] == ["activations/net.0/max"]
    assert sorted(drawn["norm by parameter"]) == sorted(f"gradients/{n}/norm" for n, _ in TinyNet().named_parameters())
    assert drawn["total norm"] == ["gradients/total_norm"] and drawn["anomaly flags"] == ["anomalies/nonfinite"]


def test_a_logger_prefix_leads_the_layouts_regexes_as_it_leads_the_tags(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb", version=0, prefix="exp")
    trainer(tmp_path, [ActivationMonitor(log_every_n_steps=1)], logger=logger, max_steps=1).fit(TinyNet(), loader())
    (title,) = layouts(tmp_path)[-1][1]
    assert title == "exp-activations: mean, std, abs_max, zero_fraction by layer"
    (regex,) = layouts(tmp_path)[-1][1][title]["std by layer"]
    tags = events(str(tmp_path)).Tags()["scalars"]
    assert [t for t in tags if re.match(regex, t)] == [f"exp-activations/net.{i}/std" for i in range(3)]


class _Blocks(L.LightningModule):
    """Six blocks of Linear + ReLU: 12 modules, 12 parameters (ActivationMonitor takes the 6 blocks too: 18 rows)."""

    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(6)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        type(self).steps += 1
        return self.blocks(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize(
    ("monitor_class", "limit", "match"),
    [
        (ActivationMonitor, 5,
         r"ActivationMonitor would log 18 rows \(108 tags a logged step\), over `max_rows`=5: .*\(e\.g\."
         r" modules='blocks\.\*\.0' for one module a block, or modules=nn\.LayerNorm\), or raise `max_rows`"
         r" \(None: no limit\)"),
        (GradientMonitor, 11, r"GradientMonitor would log 12 rows \(12 tags a logged step\), over"
                                       r" `max_rows`=11: .*modules='blocks\.\*\.0'"),
    ],
)
def test_a_selection_over_the_limit_fails_before_training_and_says_how_to_narrow_it(
    tmp_path, monitor_class, limit, match
):
    monitor = monitor_class(max_rows=limit)  # one name for both: rows are modules, or parameters
    model = _Blocks()
    _Blocks.steps = 0
    with pytest.raises(ValueError, match=match):
        trainer(tmp_path, [monitor], logger=False).fit(model, loader())
    assert _Blocks.steps == 0 and forward_hook_count(model) == 0
    monitor.max_rows = None  # no limit: the same selection trains
    trainer(tmp_path, [monitor], logger=False, max_steps=1).fit(model, loader())
    assert _Blocks.steps == 1
