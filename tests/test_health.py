"""LayerHealth: pictures in the event file, of the size promised, bounded, changing with the data; the summary."""

import io
import logging
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from matplotlib.image import imread
from torch import nn

from lightning_hooks import ActivationMonitor, GradientMonitor, LayerHealth
from lightning_hooks._health_plots import heatmap_size, profile_size
from tests.helpers import TinyNet, events, loader, trainer

HEATMAP, PROFILE = "health/activation_histograms", "health/depth_profile"


class DeadNet(TinyNet):
    """TinyNet whose first Linear has a bias far below its outputs: the ReLU after it never fires."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.net[0].bias.fill_(-20.0)


def fit(tmp_path: Any, health: LayerHealth, model: Any = None, scale: float = 1.0, steps: int = 10) -> Any:
    torch.manual_seed(0)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    data = loader()
    data.dataset.tensors = (data.dataset.tensors[0] * scale, data.dataset.tensors[1])
    callbacks = [ActivationMonitor(stats=["std", "zero_fraction"]), GradientMonitor(update_ratio=True), health]
    trainer(tmp_path, callbacks, logger=logger, max_steps=steps).fit(model or TinyNet(), data)
    logger.experiment.flush()
    return events(str(tmp_path / "tb"))


def pixels(event: Any) -> np.ndarray:
    return imread(io.BytesIO(event.encoded_image_string), format="png")


@pytest.mark.parametrize("name", ["image_every_n_steps", "max_images", "max_panels", "max_columns", "top_k"])
@pytest.mark.parametrize("value", [0, 1.5, True])
def test_bad_settings_fail_at_construction(name, value):
    with pytest.raises(ValueError, match=rf"`{name}` must be a positive int, got {value!r}"):
        LayerHealth(**{name: value})


def test_pictures_are_in_the_event_file_bounded_in_count_and_of_the_promised_size(tmp_path):
    acc = fit(tmp_path, LayerHealth(image_every_n_steps=3, max_images=3))
    assert set(acc.Tags()["images"]) == {HEATMAP, PROFILE}
    for tag, size in ((HEATMAP, heatmap_size(3)), (PROFILE, profile_size(4))):  # 3 modules; std, zeros, norm, ratio
        images = acc.Images(tag)
        # At step 0, then every 3 steps as Lightning logs (2, 5 …), capped at 3 with the last at the end.
        assert [e.step for e in images] == [0, 2, 9]
        assert {(e.width, e.height) for e in images} == {size} == {pixels(e).shape[1::-1] for e in images}


@pytest.mark.slow
def test_the_pictures_change_when_the_data_do_and_only_then(tmp_path):
    final = [pixels(fit(tmp_path / name, LayerHealth(), scale=scale).Images(HEATMAP)[-1])
             for name, scale in (("a", 1.0), ("b", 1.0), ("c", 100.0))]
    assert np.array_equal(final[0], final[1])  # drawn deterministically
    assert not np.array_equal(final[0], final[2])
    profiles = fit(tmp_path / "d", LayerHealth(image_every_n_steps=1)).Images(PROFILE)
    assert not np.array_equal(pixels(profiles[0]), pixels(profiles[-1]))  # training moves the figures


def test_the_summary_names_the_dead_layer_first_in_tensorboard_and_on_the_console(tmp_path, caplog):
    health = LayerHealth()
    with caplog.at_level(logging.INFO):
        acc = fit(tmp_path, health, model=DeadNet())
    lines = health.summary().splitlines()
    dead = lines.index("  dead units: zero fraction of outputs, highest")
    assert lines[dead + 1].split() == ["net.1", "1", "at", "step", "0"]
    assert lines[-4] == "  update ratio: farthest from 0.001" and len(lines) == 1 + 4 * 4  # top 3 of each
    assert health.summary() in caplog.text
    (text,) = acc.Tensors("health/summary/text_summary")
    assert "net.1" in text.tensor_proto.string_val[0].decode()


def test_it_adds_no_host_transfer_and_no_device_work(tmp_path, monkeypatch):
    def counted(with_health: bool) -> Counter:
        calls: Counter = Counter()
        for name in ("cpu", "item", "tolist"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _o=original, **k: (
                calls.update([_n]), _o(self, *a, **k))[1])
        callbacks = [ActivationMonitor(), GradientMonitor(update_ratio=True)]
        torch.manual_seed(0)
        logger = TensorBoardLogger(tmp_path, name=str(with_health))
        trainer(tmp_path, [*callbacks, *([LayerHealth(image_every_n_steps=1)] if with_health else [])],
                logger=logger, max_steps=4).fit(TinyNet(), loader())
        monkeypatch.undo()
        return calls

    assert counted(True) == counted(False)


def test_a_heatmap_panel_keeps_at_most_max_columns_steps_spread_over_the_run():
    health = LayerHealth(max_columns=4, max_panels=1)
    for step in range(10):
        health.record_histograms([("activations/a", {}, [step, 1.0]), ("activations/b", {}, [1.0, 1.0])],
                                 [-1.0, 0.0, 1.0], step)
        health.record_histograms([("gradients/a", {}, [1.0] * 4)], [-2.0, -1.0, 0.0, 1.0, 2.0], step)  # other bins
    assert list(health._columns) == ["a"] and health._edges == {"a": [-1.0, 0.0, 1.0]}
    assert [step for step, _ in health._columns["a"]] == [0, 4, 8]


def test_it_warns_when_there_is_nothing_to_draw_from_or_to(tmp_path):
    logger = CSVLogger(tmp_path)
    with pytest.warns(UserWarning, match="no ActivationMonitor or GradientMonitor"), \
            pytest.warns(UserWarning, match="no TensorBoardLogger, so no pictures"):
        trainer(tmp_path, [LayerHealth()], logger=logger, max_steps=1).fit(TinyNet(), loader())


def test_without_matplotlib_it_says_what_to_install(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-hooks\[health\]'"):
        LayerHealth()


def test_only_what_the_monitors_log_is_drawn(tmp_path):
    model = TinyNet()
    model.net.append(nn.Identity())
    health = LayerHealth()
    torch.manual_seed(0)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer(tmp_path, [ActivationMonitor(modules="net.0"), health], logger=logger, max_steps=2).fit(model, loader())
    assert list(health._columns) == ["net.0"]
    assert [p[0] for p in health._profiles()] == ["activation std", "zero fraction"]
