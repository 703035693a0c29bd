"""The Layers tab for real: the installed ``tensorboard`` (the entry point finds the plugin) and headless Chromium."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import lightning.pytorch as lp
import pytest
import pytorch_lightning as ptl
import torch
from torch import nn

from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth
from tests.browser import (
    DEAD,
    PLUGIN,
    browse,
    devtools,
    get,
    needs_chromium,
    tab_url,
    tensorboard,
    wait_for,
    wait_for_run,
    write_synthetic_run,
)
from tests.compat_helpers import net, package_trainer
from tests.helpers import HeadFirst, events, loader, run_reader

pytestmark = pytest.mark.slow  # a tensorboard server and headless Chromium

ROOT = Path(__file__).resolve().parent.parent


class DeadMLP(lp.LightningModule):
    """Linear -> ReLU -> Linear -> ReLU -> Linear; 28 of ``net.3``'s 32 ReLUs never fire."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        with torch.no_grad():
            self.net[2].bias[:28] = -10.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def monitors(**gradients: Any) -> list[Any]:
    return [ActivationMonitor(log_every_n_steps=1, modules=[nn.Linear, nn.ReLU],
                              stats=["std", "zero_fraction", "nonfinite_fraction"]),
            GradientMonitor(log_every_n_steps=1, granularity="module", update_ratio=True, **gradients)]


def write_runs(logdir: Path) -> None:
    """Three runs: plain, with a logger prefix, and a standalone ``pytorch_lightning`` run with a NaN at step 3."""
    for name, prefix in (("plain", ""), ("prefixed", "train")):
        torch.manual_seed(0)
        logger = lp.loggers.TensorBoardLogger(str(logdir), name=name, version=0, prefix=prefix)
        package_trainer(lp, logdir, monitors(), logger=logger).fit(DeadMLP(), loader())
        logger.experiment.flush()
    torch.manual_seed(0)
    logger = ptl.loggers.TensorBoardLogger(str(logdir), name="standalone", version=0)
    package_trainer(ptl, logdir, monitors(provenance=True), logger=logger).fit(net(ptl, nan_steps=(3,)), loader())
    logger.experiment.flush()


def status(base: str, route: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{base}/data/plugin/{PLUGIN}/{route}", timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_the_routes_through_a_real_tensorboard(tmp_path):
    write_runs(tmp_path)
    with tensorboard(tmp_path, tmp_path / "tensorboard.log") as base:
        plain = wait_for_run(base, "plain/version_0", 6)
        listing = json.loads(urllib.request.urlopen(f"{base}/data/plugins_listing").read())[PLUGIN]
        assert (listing["enabled"], listing["tab_name"], listing["loading_mechanism"]["type"]) == (True, "Layers",
                                                                                                 "IFRAME")
        wait_for_run(base, "standalone/version_0", 4)
        assert get(base, "runs")["runs"] == ["plain/version_0", "prefixed/version_0", "standalone/version_0"]

        figures = {f["key"]: f for f in plain["figures"]}
        assert list(figures)[:5] == ["activations/std", "activations/zero_fraction", "activations/nonfinite_fraction",
                                     "gradients/norm", "updates/log10_ratio"]
        zeros = figures["activations/zero_fraction"]
        assert zeros["rows"] == ["net.0", "net.1", "net.2", "net.3", "net.4"] and plain["forward_order"]
        assert zeros["steps"] == [0, 1, 2, 3, 4, 5]
        assert {(zeros["rows"][r], v) for r, _, v in zeros["marks"]} == {("net.3", "dead")}
        assert {(b["layer"], b["verdict"], b["since"]) for b in plain["banner"]} >= {("net.3", "dead", 0)}
        assert "net.1" not in {b["layer"] for b in plain["banner"] if b["verdict"] == "dead"}

        # A click on net.3 at step 2 opens its activation histogram there: all 8 x 32 outputs.
        assert zeros["histograms"][3] == "activations/net.3"
        found = get(base, "histogram", run="plain/version_0", tag="activations/net.3", step=2)
        assert found["step"] == 2 and sum(count for _, _, count in found["bins"]) == 8 * 32
        assert get(base, "histogram", run="plain/version_0", tag="activations/net.3", step=99)["step"] == 5

        # LayerHealth's bands, by the same names, from the query; errors that say what was wrong.
        assert plain["thresholds"] == {"max_zero_fraction": 0.8, "level_factor": 1.25, "norm_factor": 4.0,
                                       "ratio_factor": 4.0, "cusum": 5.0, "window": 32, "min_points": 24,
                                       "max_attention_logit": 30.0, "min_entropy_fraction": 0.1,
                                       "max_output_logit": 100.0, "max_massive_ratio": 1e4, "output_grad_factor": 4.0}
        assert plain["problems"]["dead"] == "dead units: zero fraction of outputs above 0.8"
        relaxed = get(base, "run", run="plain/version_0", max_zero_fraction=0.99)
        assert "dead" not in {b["verdict"] for b in relaxed["banner"]}
        assert relaxed["thresholds"]["max_zero_fraction"] == 0.99
        assert status(base, "run?run=plain/version_0&max_zero_fraction=lots") == (
            400, "Invalid argument: `max_zero_fraction` must be a number, got 'lots'")
        assert status(base, "run?run=plain/version_0&window=2&min_points=2") == (
            400, "Invalid argument: `window` must be an int of at least 4, got 2: pass window=4 or more")
        assert status(base, "run?run=nothing")[0] == 404
        assert status(base, "histogram?run=plain/version_0&tag=activations/net.3")[0] == 400
        # Hostile values: a message and 400, never a 500.
        histogram = "histogram?run=plain/version_0&tag=activations/net.3&step="
        for step in ("--1", urllib.parse.quote("²"), "9" * 5000):
            code, text = status(base, histogram + step)
            assert code == 400 and "`step` must be an integer of at most 18 digits" in text, (step[:9], code, text)
        assert status(base, "run?run=plain/version_0&window=" + "1" + "0" * 30) == (
            400, "Invalid argument: `window` must be at most 100000, got an int of about 31 digits: pass window=100000"
                 " or less")
        code, text = status(base, "run?run=plain/version_0&window=" + "9" * 5000)
        assert code == 400 and "`window` must be an int" in text and len(text) < 200

        # A logger prefix: the same figures under the prefix; histograms keep their plain tags.
        prefixed = get(base, "run", run="prefixed/version_0")
        keys = [f["key"] for f in prefixed["figures"]]
        assert "train-activations/zero_fraction" in keys and "train-updates/log10_ratio" in keys
        assert ("net.3", "dead") in {(b["layer"], b["verdict"]) for b in prefixed["banner"]}
        prefixed_zeros = prefixed["figures"][keys.index("train-activations/zero_fraction")]
        assert prefixed_zeros["histograms"][3] == "activations/net.3"

        # The standalone package's run: the NaN at step 3 is on the timeline, with where it began.
        standalone = get(base, "run", run="standalone/version_0")
        first = standalone["anomalies"][0]
        assert first["step"] == 3 and "nonfinite" in first["flags"]
        assert re.search(r"first non-finite output.*net\.2", first["report"])
        assert "nonfinite" in {b["verdict"] for b in standalone["banner"]}

        # Live: a point written after the server started shows on the next request (net.3 healed).
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(tmp_path / "plain" / "version_0")) as writer:
            writer.add_scalar("activations/net.3/zero_fraction", 0.1, 50)

        def healed() -> Any:
            found = get(base, "run", run="plain/version_0")
            return found if 50 in {s for f in found["figures"] for s in f["steps"]} else None

        later = wait_for(healed, 60, "step 50")
        assert ("net.3", "dead") not in {(b["layer"], b["verdict"]) for b in later["banner"]}


def layer_health_run(logdir: Path) -> None:
    """Run examples/layer_health.py (its planted dead layer is ``net.3``) into ``logdir``."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "layer_health.py"), str(logdir)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@needs_chromium
def test_the_tab_in_a_browser_marks_the_dead_layer(tmp_path):
    layer_health_run(tmp_path / "runs")
    with tensorboard(tmp_path / "runs", tmp_path / "tensorboard.log", load_fast="true") as base:
        answer = wait_for_run(base, "version_0", 13)
        step = next(f for f in answer["figures"] if f["key"] == "activations/zero_fraction")["steps"][4]
        shot = tmp_path / "layers.png"
        dom = browse(tab_url(base), screenshot=shot, size=(1100, 820))
        linked = browse(tab_url(base, layer="net.3", step=step))
        with devtools(tab_url(base)) as tools:
            tip, shown = hover_and_click(tools, "activations/zero_fraction", "net.3", column=4)
            fields, relaxed = relax_the_dead_threshold(tools)
            pull = pull_colours(tools, len(answer_pull(answer)))

    assert 'data-ready="true"' in dom
    # The strip names the planted dead layer as the run's first culprit, and so does the banner's first line.
    assert re.search(r'<tr class="lh-strip-row rank1" data-run="version_0" data-rank="1" data-culprit="net\.3"', dom)
    assert re.search(r'<ul><li data-layer="net\.3" data-verdict="dead"', dom)
    assert re.search(r'<li data-layer="net\.3" data-verdict="dead" data-since="\d+"', dom)
    # The Thresholds panel edits LayerHealth's thresholds, by their names, and the banner follows.
    assert fields == ("max_zero_fraction,level_factor,norm_factor,ratio_factor,cusum,window,min_points,"
                      "max_attention_logit,min_entropy_fraction,max_output_logit,max_massive_ratio,output_grad_factor")
    assert "net.3" not in relaxed
    marked = re.search(r'data-figure="activations/zero_fraction" data-marked-rows="([^"]*)"', dom)[1].split(",")
    assert "net.3" in marked and "net.1" not in marked
    # Hovering over net.3's fifth cell names the layer, the step, the value and its verdict; a click
    # opens its histogram there.
    assert re.fullmatch(rf"net\.3\nstep {step}\nvalue 0\.[89]\d*  ⚠ dead units: zero fraction of outputs above 0\.8",
                        tip), tip
    assert re.match(rf"net\.3 · histogram activations/net\.3 at step {step} · \d+ values", shown), shown
    # So does the deep link.
    assert re.search(rf'data-histogram="activations/net\.3" data-step="{step}"', linked)
    # The screenshot shows the marks: the marked cells' red outlines are there in pixels.
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    red = (abs(pixels[..., 0] - 1.0) < 0.06) & (abs(pixels[..., 1] - 0.09) < 0.06) & (abs(pixels[..., 2] - 0.27) < 0.06)
    assert red.sum() > 200
    # The pull is read for its sign: a scale symmetric about 0, neutral grey there, blue below and red above, the
    # colour bar saying what each side means; every cell on the side of its value.
    values = answer_pull(answer)
    assert float(pull["lo"]) == -float(pull["hi"]) == -max(abs(v) for v in values if v is not None)
    top, middle, bottom = pull["bar"]
    assert max(middle) - min(middle) < 8 and min(middle) > 235  # neutral at 0
    assert top[0] > top[2] + 60 and bottom[2] > bottom[0] + 60  # red at the top, blue at the bottom
    assert "blue below 0, the loss asks the layer's outputs to grow; red above 0, to shrink" in pull["stated"]
    for value, (r, _, b) in zip(values, pull["cells"]):
        if value is not None and abs(value) > 0.1 * float(pull["hi"]):
            assert (b > r) if value < 0 else (r > b), (value, r, b)


def answer_pull(answer: dict[str, Any]) -> list[Any]:
    """The pull's logged values in the route's answer (one row: the prediction layer)."""
    return next(f for f in answer["figures"] if f["key"] == "activation_grads/pull")["values"][0]


def pull_colours(tools: Any, steps: int) -> dict[str, Any]:
    """The pull's heatmap: its scale's ends, the colour bar's top, middle and bottom pixels, each cell's, the legend."""
    return tools.evaluate("""((steps) => { const box = document.querySelector('[data-figure="activation_grads/pull"]');
        const canvas = box.querySelector('canvas'), d = canvas.dataset, g = canvas.getContext('2d');
        const ratio = window.devicePixelRatio || 1;
        const px = (x, y) => [...g.getImageData(Math.round(x * ratio), Math.round(y * ratio), 1, 1).data].slice(0, 3);
        const x = +d.barX + 5, y = (p) => +d.barTop + p * (+d.barHeight - 1);
        return {lo: d.scaleLo, hi: d.scaleHi, bar: [px(x, y(0)), px(x, y(0.5)), px(x, y(1))],
                stated: box.querySelector('.lh-scale').textContent,
                cells: [...Array(steps).keys()].map((c) => px(+d.labelWidth + (c + 0.5) * +d.cell, +d.top + 6))}; })"""
                          + f"({steps})")


def relax_the_dead_threshold(tools: Any) -> tuple[str, str]:
    """Open the Thresholds panel, set ``max_zero_fraction`` to 0.99: its fields, then the redrawn banner's layers."""
    fields = tools.evaluate("""(() => { [...document.querySelectorAll('button')].find((b) => b.textContent
        === 'Thresholds').click(); return [...document.querySelectorAll('#lh-thresholds input')].map((i) => i.name)
        .join(','); })()""")
    tools.evaluate("""(() => { const input = document.querySelector('#lh-thresholds input[name=max_zero_fraction]');
        input.value = '0.99'; input.dispatchEvent(new Event('change')); return true; })()""")
    banner = "'layers:' + ((b => (b && b.dataset.layers) || '')(document.querySelector('.lh-banner')))"
    return fields, wait_for(lambda: (found := tools.evaluate(banner)) and "net.3" not in found and found, 30,
                            "the banner without net.3")


def hover_and_click(tools: Any, figure: str, layer: str, column: int) -> tuple[str, str]:
    """Move the mouse over a heatmap's cell, then click it: the tooltip's text, then the histogram panel's."""
    box = canvas_box(tools, figure)
    row = box["rows"].split(",").index(layer)
    x = box["x"] + float(box["labelWidth"]) + (column + 0.5) * float(box["cell"])
    y = box["y"] + float(box["top"]) + (row + 0.5) * float(box["rowHeight"])
    tools.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
    tip = tools.evaluate("document.querySelector('.lh-tip').textContent")
    for kind in ("mousePressed", "mouseReleased"):
        tools.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
    panel = f"(p => p && p.textContent)(document.querySelector('[data-figure=\"{figure}\"] [data-histogram]'))"
    return tip, wait_for(lambda: tools.evaluate(panel), 30, "histogram panel")


@needs_chromium
def test_a_200_module_run_loads_and_draws_quickly(tmp_path):
    names = write_synthetic_run(tmp_path / "big", modules=200, steps=100)
    with tensorboard(tmp_path, tmp_path / "tensorboard.log", load_fast="true") as base:
        answer = wait_for_run(base, "big", 100)
        assert [f["rows"] for f in answer["figures"]][0] == names
        dom = browse(tab_url(base))
        with devtools(tab_url(base)) as tools:
            timings = json.loads(tools.evaluate("JSON.stringify(document.body.dataset)"))
            collapsed = canvas_rows(tools, "activations/zero_fraction")
            click_label(tools, "activations/zero_fraction", "encoder.layers.6.*")
            expanded = canvas_rows(tools, "activations/zero_fraction")
    assert timings["ready"] == "true" and int(timings["renderMs"]) < 5000, timings
    marked = re.search(r'data-figure="activations/zero_fraction" data-marked-rows="([^"]*)"', dom)[1].split(",")
    assert marked == [DEAD]
    # 200 rows start as 19 groups (embed, 17 blocks, head), the one holding the marked layer open: 30 rows.
    block = [name for name in names if name.startswith("encoder.layers.7.")]
    assert len(collapsed) == 30 and collapsed[7] == "encoder.layers.6.*" and collapsed[8:20] == block
    # A click on a block's label opens it in place.
    assert expanded[7:19] == [name for name in names if name.startswith("encoder.layers.6.")]
    assert expanded[19:31] == block


def canvas_box(tools: Any, figure: str) -> dict[str, Any]:
    """Where a heatmap's canvas is on the page, and its geometry (label width, cell size, rows)."""
    return tools.evaluate(f"""(() => {{ const canvas = document.querySelector('[data-figure="{figure}"] canvas');
        canvas.scrollIntoView({{block: "start"}}); const box = canvas.getBoundingClientRect();
        return {{x: box.left, y: box.top, ...canvas.dataset}}; }})()""")


def canvas_rows(tools: Any, figure: str) -> list[str]:
    return canvas_box(tools, figure)["rows"].split(",")


def click_label(tools: Any, figure: str, row: str) -> None:
    box = canvas_box(tools, figure)
    y = box["y"] + float(box["top"]) + (box["rows"].split(",").index(row) + 0.5) * float(box["rowHeight"])
    for kind in ("mousePressed", "mouseReleased"):
        tools.call("Input.dispatchMouseEvent", type=kind, x=box["x"] + 20, y=y, button="left", clickCount=1)


class SharedModules(lp.LightningModule):
    """One ReLU applied after every Linear, and one hidden Linear applied twice (``first, act, shared, act, shared,
    act, head``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.shared, self.act, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.act(self.shared(self.act(self.shared(self.act(self.first(x))))))
        return nn.functional.mse_loss(self.head(hidden), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_parameter_free_module_called_again_ranks_at_its_last_call_one_with_parameters_at_its_first(tmp_path):
    """The shared ReLU's later calls follow ``shared``: it ranks after it (a victim of a fault there, not a module
    before it); ``shared`` keeps its first call's place. LayerHealth judges in the same order."""
    torch.manual_seed(0)
    logger = lp.loggers.TensorBoardLogger(str(tmp_path), name="run", version=0)
    health = LayerHealth()
    package_trainer(lp, tmp_path, [*monitors(), health], logger=logger, max_steps=2).fit(SharedModules(), loader())
    logger.experiment.flush()
    (order,) = events(logger.log_dir).Tensors("layers/forward_order")
    assert json.loads(order.tensor_proto.string_val[0]) == ["first", "shared", "act", "head"]
    depth = health._verdicts.judge.depth
    assert sorted(("first", "shared", "act", "head"), key=depth.__getitem__) == ["first", "shared", "act", "head"]



def test_the_forward_order_is_one_forward_pass_with_gradient_accumulation(tmp_path):
    """Two micro-batches a step: the second's calls do not move the shared ReLU after the head."""
    torch.manual_seed(0)
    logger = lp.loggers.TensorBoardLogger(str(tmp_path), name="run", version=0)
    package_trainer(lp, tmp_path, monitors(), logger=logger, max_steps=2, accumulate_grad_batches=2).fit(
        SharedModules(), loader())
    logger.experiment.flush()
    (order,) = events(logger.log_dir).Tensors("layers/forward_order")
    assert json.loads(order.tensor_proto.string_val[0]) == ["first", "shared", "act", "head"]


def test_rows_follow_the_forward_order_activation_monitor_records(tmp_path):
    torch.manual_seed(0)
    logger = lp.loggers.TensorBoardLogger(str(tmp_path), name="run", version=0)
    package_trainer(lp, tmp_path, monitors(), logger=logger, max_steps=3).fit(HeadFirst(), loader())
    logger.experiment.flush()
    (order,) = events(logger.log_dir).Tensors("layers/forward_order")  # once per fit, the tab's own summary
    assert (order.step, json.loads(order.tensor_proto.string_val[0])) == (0, ["trunk.0", "trunk.1", "head"])

    reader = run_reader(tmp_path)
    figures = {figure.key: figure for figure in reader.figures("run/version_0")}
    assert figures["activations/std"].rows == ["trunk.0", "trunk.1", "head"]  # neither registration's nor name order
    assert figures["gradients/norm"].rows == ["trunk.0", "head"]
