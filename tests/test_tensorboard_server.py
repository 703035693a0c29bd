"""What a user sees: the real ``tensorboard`` server, read over its HTTP data API."""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
import urllib.error
import urllib.parse
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn

from lightning_hooks import STAT_NAMES, ActivationMonitor, GradientMonitor, LayerHealth
from lightning_hooks.output._health_plots import image_size
from tests.browser import tensorboard, wait_for
from tests.helpers import events, trainer
from tests.zoo import F, LitNet

pytestmark = pytest.mark.slow  # each starts a real TensorBoard server

RUN = "tb/version_0"


def loader_of(features: int, n: int = 24) -> torch.utils.data.DataLoader:
    """A regression loader over ``n`` random samples of ``features`` features, batches of 8."""
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(n, 1)), batch_size=8)


@pytest.fixture
def serve(tmp_path):
    """Start ``tensorboard`` over a log dir on 127.0.0.1 (a free port it picks), yield a getter
    for its JSON API, and always stop it."""
    with ExitStack() as servers:
        logs = itertools.count()

        def start(logdir: Path):
            base = servers.enter_context(tensorboard(logdir, tmp_path / f"tensorboard{next(logs)}.log"))

            def get(route: str, raw: bool = False, **params: str):
                """The JSON at ``route`` (or with ``raw`` its bytes)."""
                query = f"?{urllib.parse.urlencode(params)}" if params else ""
                with urllib.request.urlopen(f"{base}{route}{query}", timeout=10) as response:
                    body = response.read()
                    return body if raw else json.loads(body)

            return get

        yield start


def _loaded(get, tag: str):
    """Wait until the server has read ``tag`` for our run (it loads event files in the background)."""

    def check():
        try:
            return RUN in get("/data/runs") and tag in get("/data/plugin/scalars/tags").get(RUN, {})
        except (urllib.error.URLError, ConnectionError):
            return False

    wait_for(check, 60, f"scalar {tag!r} for run {RUN!r}")


def test_tensorboard_serves_the_figures(tmp_path, serve):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(F, 8), nn.ReLU(), nn.Linear(8, 1))
    outputs: list[torch.Tensor] = []
    net[1].register_forward_hook(lambda module, args, out: outputs.append(out.detach().clone()))
    x = torch.randn(24, F, generator=torch.Generator().manual_seed(1))
    x[9, 2] = math.nan  # step 1 holds a NaN: one NaN row through the ReLU, then NaN weights
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(24, 1)), batch_size=8)
    monitor = ActivationMonitor(log_every_n_steps=1, modules=["net.1"], stats=STAT_NAMES)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer(tmp_path, [monitor], logger=logger, max_steps=3).fit(LitNet(net), data)
    logger.experiment.flush()

    get = serve(tmp_path)
    _loaded(get, "activations/net.1/zero_fraction")

    tags = get("/data/plugin/scalars/tags")[RUN]
    assert {f"activations/net.1/{s}" for s in ("mean", "zero_fraction", "nan_count", "count")} <= set(tags)
    assert list(get("/data/plugin/histograms/tags")[RUN]) == ["activations/net.1"]

    def scalars(stat):
        rows = get("/data/plugin/scalars/scalars", tag=f"activations/net.1/{stat}", run=RUN)
        return {step: float(value) for _, step, value in rows}  # NaN comes as the string "NaN"

    assert scalars("count") == {0: 64, 1: 64, 2: 64}
    assert scalars("nan_count") == {0: 0, 1: 8, 2: 64}  # NaN row at step 1, NaN weights after
    for step in (0, 1):
        out = outputs[step]
        finite = out[torch.isfinite(out)].double()
        assert scalars("zero_fraction")[step] == pytest.approx(float((out == 0).double().mean()))
        assert scalars("mean")[step] == pytest.approx(float(finite.mean()), rel=1e-5)
    assert math.isnan(scalars("mean")[2])

    series = get("/data/plugin/histograms/histograms", tag="activations/net.1", run=RUN)
    hist = {step: buckets for _, step, buckets in series}
    assert sorted(hist) == [0, 1]  # step 2 had no finite value to draw
    for step, buckets in hist.items():
        out = outputs[step]
        finite = out[torch.isfinite(out)]
        assert sum(c for _, _, c in buckets) == finite.numel()
        assert buckets[0][0] == pytest.approx(float(finite.min()))  # left edge of the first: true min
        assert buckets[-1][1] == pytest.approx(float(finite.max()))  # right edge of the last: true max
        zeros = [c for left, right, c in buckets if right == 0.0]
        assert zeros == [int((finite == 0).sum())]  # the (-1e-6, 0] bin holds the dead units


class _Encoder(nn.Module):
    """A 12-layer ``nn.TransformerEncoder`` (d_model 32) between a Linear embedding and a Linear head."""

    def __init__(self, depth: int = 12, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(F, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x))).mean(1)


def test_a_12_layer_transformer_logs_a_few_hundred_tags_and_one_chart_per_stat_across_layers(tmp_path, serve):
    torch.manual_seed(0)
    x = torch.randn(16, 6, F, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(16, 1)), batch_size=8)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    model = LitNet(_Encoder())
    trainer(tmp_path, [ActivationMonitor(), GradientMonitor()], logger=logger, max_steps=2).fit(model, data)
    logger.experiment.flush()

    # Per block: 6 rows (the block itself, a block of a stack, and attention whole, linear1, linear2,
    # norm1, norm2) x 3 stats (mean, std, abs_max) and 12 parameter norms; plus the embedding and
    # head (2 x 3 + 4), the total norm and one flag. No module here outputs an exact zero (the
    # block's ReLU is a function, not a module) and the run stays finite, so the default zero_fraction and
    # nonfinite_fraction, flat at 0 by construction, are not logged: 520 tags before that rule.
    tags = events(str(tmp_path)).Tags()
    params = len(list(model.parameters()))
    assert params == 12 * 12 + 4
    assert len(tags["scalars"]) == (12 * 6 + 2) * 3 + params + 2 == 372
    assert len(tags["histograms"]) == 12 * 6 + 2 + params == 222

    get = serve(tmp_path)
    _loaded(get, "activations/net.head/std")
    layout = get("/data/plugin/custom_scalars/layout")
    charts = {c["title"]: {ch["title"]: ch["multiline"]["tag"] for ch in c["chart"]} for c in layout["category"]}
    assert list(charts) == ["activations: mean, std, abs_max by layer",
                            "gradients: norm by parameter, total norm, anomaly flags"]
    charts = dict(zip(("activations", "gradients"), charts.values()))
    for category, chart, rows in [("activations", "std by layer", 74), ("activations", "abs_max by layer", 74),
                                  ("gradients", "norm by parameter", params)]:
        (regex,) = charts[category][chart]
        served = get("/data/plugin/custom_scalars/scalars", run=RUN, tag=regex)
        assert served["regex_valid"] and len(served["tag_to_events"]) == rows, chart
        assert all(len(points) == 2 for points in served["tag_to_events"].values())  # steps 0 and 1
    encoder_3 = [t for t in get("/data/plugin/scalars/tags")[RUN] if re.search(r"encoder\.layers\.3\.", t)]
    assert {t.split("/")[0] for t in encoder_3} == {"activations", "gradients"}  # one filter shows both


def test_tensorboard_serves_the_layer_health_pictures(tmp_path, serve):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(F, 8), nn.ReLU(), nn.Linear(8, 1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, F), torch.zeros(24, 1)),
                                       batch_size=8)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    callbacks = [ActivationMonitor(log_every_n_steps=1), GradientMonitor(log_every_n_steps=1), LayerHealth()]
    trainer(tmp_path, callbacks, logger=logger, max_steps=3).fit(LitNet(net), data)
    logger.experiment.flush()

    get = serve(tmp_path)
    _loaded(get, "gradients/total_norm")
    tag = "health/activation_histograms/net.1"
    assert {tag, "health/depth_profile/zero_fraction"} <= set(get("/data/plugin/images/tags")[RUN])
    entries = get("/data/plugin/images/images", run=RUN, tag=tag)
    assert [e["step"] for e in entries] == [0, 2]  # the first logged step, and the end of training
    png = get(f"/data/plugin/images/individualImage?{entries[-1]['query']}", raw=True)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert (width, height) == image_size() == (480, 320)


def test_every_runs_charts_survive_tensorboards_layout_merge(tmp_path, serve):
    # TensorBoard merges runs' layouts by category title in run-name order and drops what a third
    # run adds to a category first seen in the second: with one title per kind, run_c's
    # "norm by module" was lost. Titles that name their charts keep every run's charts.
    runs = {
        "run_a": [ActivationMonitor(log_every_n_steps=1, stats=["std", "abs_max"])],
        "run_b": [ActivationMonitor(log_every_n_steps=1), GradientMonitor(log_every_n_steps=1)],
        "run_c": [ActivationMonitor(log_every_n_steps=1, stats=["mean", "std"]),
                  GradientMonitor(log_every_n_steps=1, granularity="module")],
    }
    written = {}
    for run, callbacks in runs.items():
        torch.manual_seed(0)
        logger = TensorBoardLogger(tmp_path, name=run, version=0)
        net = nn.Sequential(nn.Linear(F, 8), nn.ReLU(), nn.Linear(8, 1))
        trainer(tmp_path, callbacks, logger=logger, max_steps=2).fit(LitNet(net), loader_of(F))
        logger.experiment.flush()
        layout = events(logger.log_dir).Tensors("custom_scalars__config__")[-1]
        written[run] = {(c.title, ch.title, tuple(ch.multiline.tag))
                        for c in layout_pb2.Layout.FromString(layout.tensor_proto.string_val[0]).category
                        for ch in c.chart}

    get = serve(tmp_path)

    def loaded():  # each run's event file read to its end: its last layout came before its last scalars
        try:
            tags = get("/data/plugin/scalars/tags")
        except (urllib.error.URLError, ConnectionError):
            return False
        return all("activations/net.2/std" in tags.get(f"{run}/version_0", {}) for run in runs)

    wait_for(loaded, 60, "scalars of the three runs")
    served = {(c["title"], ch["title"], tuple(ch["multiline"]["tag"]))
              for c in get("/data/plugin/custom_scalars/layout")["category"] for ch in c["chart"]}
    assert served == set().union(*written.values())
    charts = {chart for _, chart, _ in served}
    assert charts == {"std by layer", "mean by layer", "abs_max by layer", "zero_fraction by layer",
                      "norm by parameter", "norm by module", "total norm", "anomaly flags"}
    # run_b's layout was written again at step 0, once the ReLU's first zeros were logged: that one is served.
    assert ("activations: mean, std, abs_max, zero_fraction by layer", "zero_fraction by layer",
            ("activations/.*/zero_fraction$",)) in served
