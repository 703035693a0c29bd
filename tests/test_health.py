"""LayerHealth: pictures in the event file, of the size promised, bounded, changing with the data; the summary."""

import io
import logging
import math
import os
import sys
from collections import Counter
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from matplotlib.image import imread
from torch import nn

from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth
from lightning_hooks.output._health_plots import heatmap_figure, image_size, to_rgb
from lightning_hooks.output.figures import HistogramBlock
from tests.helpers import TinyNet, events, host_transfers, loader, run_reader, trainer

HEATMAP, PROFILE = "health/activation_histograms", "health/depth_profile"
PROFILES = [f"{PROFILE}/{name}" for name in ("activation_std", "zero_fraction", "gradient_norm", "update_ratio")]


class DeadNet(TinyNet):
    """TinyNet whose first Linear has a bias far below its outputs: the ReLU after it never fires."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        with torch.no_grad():
            self.net[0].bias.fill_(-20.0)


def fit(tmp_path: Any, health: LayerHealth, model: Any = None, scale: float = 1.0, steps: int = 10,
        stats: Any = ("std", "zero_fraction")) -> Any:
    torch.manual_seed(0)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    data = loader()
    data.dataset.tensors = (data.dataset.tensors[0] * scale, data.dataset.tensors[1])
    callbacks = [ActivationMonitor(stats=stats), GradientMonitor(update_ratio=True), health]
    trainer(tmp_path, callbacks, logger=logger, max_steps=steps).fit(model or TinyNet(), data)
    logger.experiment.flush()
    return events(str(tmp_path / "tb"))


def pixels(event: Any) -> np.ndarray:
    return imread(io.BytesIO(event.encoded_image_string), format="png")


@pytest.mark.parametrize("name", ["image_every_n_steps", "max_images", "max_panels", "max_columns", "top_k"])
@pytest.mark.parametrize(("value", "kind"), [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_settings_fail_at_construction(name, value, kind):
    with pytest.raises(kind, match=rf"`{name}` must be a positive int, got {value!r}"):
        LayerHealth(**{name: value})


@pytest.mark.parametrize(
    ("name", "value", "kind", "match"),
    [
        ("max_zero_fraction", 0, ValueError, r"`max_zero_fraction` must be a number in \(0, 1\], got 0"),
        ("max_zero_fraction", 1.5, ValueError, r"`max_zero_fraction` must be a number in \(0, 1\], got 1\.5"),
        ("max_zero_fraction", "0.8", TypeError, r"`max_zero_fraction` must be a number in \(0, 1\], got '0\.8' \(str"),
        ("level_factor", 1, ValueError, r"`level_factor` must be a finite number > 1, got 1"),
        ("norm_factor", math.inf, ValueError, r"`norm_factor` must be a finite number > 1, got inf"),
        ("ratio_factor", "4", TypeError, r"`ratio_factor` must be a finite number > 1, got '4'"),
        ("window", 2, ValueError, r"`window` must be an int of at least 4, got 2"),
    ],
)
def test_bad_bands_fail_at_construction(name, value, kind, match):
    with pytest.raises(kind, match=match):
        LayerHealth(**{name: value})


def test_pictures_are_in_the_event_file_bounded_in_count_and_of_the_promised_size(tmp_path):
    acc = fit(tmp_path, LayerHealth(image_every_n_steps=3, max_images=3))
    heatmaps = [f"{HEATMAP}/net.{i}" for i in range(3)]
    assert set(acc.Tags()["images"]) == {*heatmaps, *PROFILES}  # one picture per module, one per figure
    for tag in (*heatmaps, *PROFILES):
        images = acc.Images(tag)
        # At step 0, then every 3 steps as Lightning logs (2, 5 …), capped at 3 with the last at the end.
        assert [e.step for e in images] == [0, 2, 9]
        assert {(e.width, e.height) for e in images} == {image_size()} == {pixels(e).shape[1::-1] for e in images}
    assert image_size() == (480, 320)  # shown at 70-100 % in TensorBoard's cards, not as a thumbnail


@pytest.mark.slow
def test_the_pictures_change_when_the_data_do_and_only_then(tmp_path):
    final = [pixels(fit(tmp_path / name, LayerHealth(), scale=scale).Images(f"{HEATMAP}/net.0")[-1])
             for name, scale in (("a", 1.0), ("b", 1.0), ("c", 100.0))]
    assert np.array_equal(final[0], final[1])  # drawn deterministically
    assert not np.array_equal(final[0], final[2])
    profiles = fit(tmp_path / "d", LayerHealth(image_every_n_steps=1)).Images(f"{PROFILE}/activation_std")
    assert not np.array_equal(pixels(profiles[0]), pixels(profiles[-1]))  # training moves the figures


def _red(image: np.ndarray) -> int:
    """Pixels in the warning red (the dead strip, a dead module's title)."""
    rgb = image[..., :3] * 255 if image.dtype != np.uint8 else image[..., :3]
    return int(((rgb[..., 0] > 180) & (rgb[..., 1] < 120) & (rgb[..., 2] < 120)).sum())


def test_exact_zeros_are_drawn_apart_and_a_dead_module_stands_out_from_a_half_zero_one():
    edges = [-2.0, -1.0, 0.0, 1.0, 2.0]  # exact zeros land in the (-1, 0] bin, with the small negatives
    health = LayerHealth()
    for step in range(4):
        health.record_histograms(HistogramBlock.of("activations", [
            ("dead", {"zero_fraction": 0.95, "count": 100}, [0, 95, 5, 0]),
            ("half", {"zero_fraction": 0.5, "count": 100}, [0, 60, 30, 10]),
        ]), edges, step)
    columns = health._histograms.columns
    assert [(s, list(c), z) for s, c, z in columns["half"]][0] == (0, [0, 10, 30, 10], 50)
    figures = {name: to_rgb(heatmap_figure(name, columns[name], edges, 0.8)) for name in ("dead", "half")}
    assert _red(figures["dead"]) > 20 * _red(figures["half"]) > 0  # the half-zero one: only the threshold line
    assert figures["dead"].shape[1::-1] == image_size()


def test_a_healthy_run_is_called_healthy_and_the_summary_is_printed_once(tmp_path, caplog):
    health = LayerHealth()
    with caplog.at_level(logging.INFO):
        fit(tmp_path, health, model=TinyNet(lr=5e-4), stats=None)
    assert health.summary() == "Layer health at step 9: healthy (no layer out of its usual range; see" \
                               " docs/verdicts.md)."
    assert caplog.text.count("Layer health at step") == 1


def test_the_summary_names_the_dead_layer_first_in_tensorboard_and_on_the_console(tmp_path, caplog):
    health = LayerHealth()
    with caplog.at_level(logging.INFO):
        acc = fit(tmp_path, health, model=DeadNet(lr=5e-4))
    lines = health.summary().splitlines()
    # The dead ReLU, first in forward order; the gradients it cuts off behind it are what it did, counted, not named;
    # then the diagnosis, with what usually helps.
    assert lines[lines.index("Diagnosis:") + 1] == "  net.1: dead units since step 0, worst 1, 1.25x the bound 0.8"
    assert lines[lines.index("Diagnosis:") + 2].startswith("    - look at the initialisation")  # dead from the start
    assert lines[:lines.index("Diagnosis:")] == ["Layer health at step 9: 1 layer unhealthy now",
                                                 "  dead units: zero fraction of outputs above 0.8",
                                                 "    net.1                    worst 1          since step 0"]
    assert caplog.text.count(health.summary()) == 1
    (text,) = acc.Tensors("health/summary/text_summary")
    assert "net.1" in text.tensor_proto.string_val[0].decode()


def test_its_pull_rides_the_monitors_one_transfer_a_logged_step_makes_no_more_host_reads_with_it(tmp_path):
    def counted(with_health: bool) -> Counter:
        callbacks = [ActivationMonitor(), GradientMonitor(update_ratio=True)]
        torch.manual_seed(0)
        logger = TensorBoardLogger(tmp_path, name=str(with_health))
        with host_transfers() as calls:
            trainer(tmp_path, [*callbacks, *([LayerHealth(image_every_n_steps=1)] if with_health else [])],
                    logger=logger, max_steps=4).fit(TinyNet(), loader())
        return calls

    added = counted(True)
    added.subtract(counted(False))
    pulls = events(str(tmp_path / "True")).Scalars("activation_grads/net.2/pull")
    assert [p.step for p in pulls] == [1, 2, 3]  # from the step after the forward order is known on
    assert {name: n for name, n in added.items() if n} == {}  # every step logged: none more on any of them


def test_a_fit_that_raises_after_the_pull_was_handed_over_leaves_no_tensor_with_the_monitor(tmp_path):
    """The pull waits with the monitor until the step is logged; a fit that raises before then lets it go."""

    class Boom(L.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if trainer.global_step == 2:
                raise RuntimeError("boom")

    monitor = ActivationMonitor()
    torch.manual_seed(0)
    run = trainer(tmp_path, [monitor, LayerHealth(image_every_n_steps=1), Boom()], max_steps=4)
    taken = []
    original = monitor.carry
    monitor.carry = lambda *args: taken.append(args[0]) or original(*args)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"):
        run.fit(TinyNet(), loader())
    assert 2 in taken  # the raising step's pull was handed over before the raise
    assert monitor._carried == [] and monitor._pending_step is None


def test_a_heatmap_panel_keeps_at_most_max_columns_steps_spread_over_the_run():
    health = LayerHealth(max_columns=4, max_panels=1)
    for step in range(10):
        health.record_histograms(HistogramBlock.of("activations", [("a", {}, [step, 1.0]), ("b", {}, [1.0, 1.0])]),
                                 [-1.0, 0.0, 1.0], step)
        health.record_histograms(HistogramBlock.of("gradients", [("a", {}, [1.0] * 4)]),  # other bins
                                 [-2.0, -1.0, 0.0, 1.0, 2.0], step)
    assert list(health._histograms.columns) == ["a"] and health._histograms.edges == {"a": [-1.0, 0.0, 1.0]}
    assert [step for step, _, _ in health._histograms.columns["a"]] == [0, 4, 8]


def test_it_warns_when_there_is_nothing_to_draw_from_or_to(tmp_path):
    logger = CSVLogger(tmp_path)
    with pytest.warns(UserWarning, match="no ActivationMonitor or GradientMonitor"), \
            pytest.warns(UserWarning, match="no TensorBoardLogger, so no pictures"):
        trainer(tmp_path, [LayerHealth()], logger=logger, max_steps=1).fit(TinyNet(), loader())


def test_without_matplotlib_the_verdict_is_still_given_and_the_warning_says_what_to_install(tmp_path, monkeypatch,
                                                                                         caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it gives: an ImportError
    health = LayerHealth(image_every_n_steps=1)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    with pytest.warns(UserWarning, match="matplotlib is not installed, so no pictures.*pip install matplotlib"), \
            caplog.at_level(logging.INFO, logger="lightning_hooks"):
        torch.manual_seed(0)
        trainer(tmp_path, [ActivationMonitor(), GradientMonitor(), health], logger=logger).fit(DeadNet(), loader())
    assert "net.1" in health.summary() and caplog.text.count("Layer health at step") == 1
    assert not [tag for tag in events(logger.log_dir).Tags()["images"] if tag.startswith("health/")]


def test_only_what_the_monitors_log_is_drawn(tmp_path):
    model = TinyNet()
    model.net.append(nn.Identity())
    health = LayerHealth()
    torch.manual_seed(0)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer(tmp_path, [ActivationMonitor(modules="net.0"), health], logger=logger, max_steps=2).fit(model, loader())
    assert list(health._histograms.columns) == ["net.0"]
    assert set(events(str(tmp_path)).Tags()["images"]) == {f"{HEATMAP}/net.0", f"{PROFILE}/activation_std"}


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["module", "parameter"])
def test_the_layers_tab_names_the_layers_and_problems_the_summary_names(tmp_path, granularity):
    """examples/layer_health.py's run: the tab's banner, read from the event file, is LayerHealth's verdict.

    The tab replays every figure of the run through LayerHealth's judge; per parameter, the
    biases' ratios are left out by both.
    """
    import importlib.util

    from lightning_hooks.output._health_verdicts import Bands
    from lightning_hooks.tensorboard_plugin.verdicts import banner, judge

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    spec = importlib.util.spec_from_file_location("layer_health_example", os.path.join(examples, "layer_health.py"))
    example = importlib.util.module_from_spec(spec)
    monkeypatch_path = [examples, *sys.path]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "path", monkeypatch_path)  # its `_quiet` helper
        spec.loader.exec_module(example)
    L.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(tmp_path, name="", version=0)
    health = LayerHealth(max_images=1)
    callbacks = [ActivationMonitor(log_every_n_steps=5, modules=[nn.Linear, nn.ReLU]),
                 GradientMonitor(log_every_n_steps=5, granularity=granularity, update_ratio=True), health]
    trainer(tmp_path, callbacks, logger=logger, max_steps=-1, max_epochs=2, log_every_n_steps=5).fit(
        example.MLP(), example.data())
    logger.experiment.flush()

    reader = run_reader(tmp_path)
    unjudged = reader.unjudged_ratios("version_0")
    tab = {(b["layer"], b["verdict"], b["since"])
           for b in banner(judge(reader.figures("version_0"), Bands(), unjudged), Bands())}
    summary = {(layer, problem, e.first) for (problem, layer), e in health._verdicts.episodes.items() if e.ongoing}
    assert tab == summary
    assert ("net.3", "dead") in {(layer, problem) for layer, problem, _ in tab}  # the first dead ReLU
    if granularity == "parameter":
        assert unjudged == {"net.0.bias", "net.2.bias", "net.4.bias", "net.6.bias"}


class _TeXName(TinyNet):
    """A first layer whose name holds ``$``: legal for a module, and TeX to matplotlib by default."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential()
        self.net.add_module("a$\\undefined{$", nn.Linear(8, 16))
        self.net.add_module("act", nn.ReLU())
        self.net.add_module("out", nn.Linear(16, 1))


def test_a_module_name_that_reads_as_tex_is_drawn_as_text_and_the_run_goes_on(tmp_path):
    import warnings

    callbacks = [ActivationMonitor(log_every_n_steps=1), GradientMonitor(log_every_n_steps=1),
                 LayerHealth(image_every_n_steps=2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, callbacks, max_steps=4).fit(_TeXName(), loader())
    assert not [w for w in caught if "drawing the pictures" in str(w.message)]
    images = events(str(tmp_path)).Tags()["images"]
    assert any("undefined" in tag for tag in images) and "health/depth_profile/zero_fraction" in images
