"""Every callback configured from YAML through LightningCLI, as a user's config file would."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from lightning.pytorch.cli import LightningCLI
from torch import nn

from lightning_hooks import (
    ActivationMonitor,
    FeatureExtractor,
    GradientAnomalyStopping,
    GradientMonitor,
    GradientTransform,
    load_features,
)
from tests.zoo import metric_series

MODULE = '''
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Demo(L.LightningModule):
    def __init__(self, width: int = 8, lr: float = 0.05):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class DemoData(L.LightningDataModule):
    def __init__(self, n: int = 32, batch_size: int = 8):
        super().__init__()
        x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(x, x.sum(1, keepdim=True))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)
'''

CALLBACKS = '''
  callbacks:
    - class_path: lightning_hooks.ActivationMonitor
      init_args:
        log_every_n_steps: 1
        modules: ["net.0", torch.nn.ReLU]
        stats: [mean, zero_fraction, count]
        histogram: false
        bins: [-1.0, 0.0, 1.0]
        inputs: true
        stages: [train, validate]
    - class_path: lightning_hooks.ActivationMonitor
      init_args:
        modules: torch.nn.Linear
        stats: [count]
    - class_path: lightning_hooks.GradientTransform
      init_args:
        scale: {"net.0": 0.5}
        clip_norm: {"net.2": 10.0}
    - class_path: lightning_hooks.GradientMonitor
      init_args:
        log_every_n_steps: 1
        granularity: module
        modules: [torch.nn.Linear]
        stats: [norm]
        norm_threshold: 1000.0
        provenance: true
    - class_path: lightning_hooks.GradientAnomalyStopping
      init_args:
        action: warn
        patience: 1
        norm_threshold: 1000.0
    - class_path: lightning_hooks.FeatureExtractor
      init_args:
        modules: "net.1"
        dirpath: {tmp}/features
        stages: [train]
'''


@pytest.fixture(autouse=True)
def no_command_line(monkeypatch):
    """LightningCLI(args=...) warns when sys.argv holds arguments as well: here, pytest's."""
    monkeypatch.setattr(sys, "argv", sys.argv[:1])


def write_project(tmp_path, max_steps: int = 2):
    (tmp_path / "clidemo.py").write_text(MODULE)
    config = textwrap.dedent(f"""
        seed_everything: 0
        trainer:
          accelerator: cpu
          max_steps: {max_steps}
          limit_val_batches: 2
          val_check_interval: 2
          num_sanity_val_steps: 0
          enable_progress_bar: false
          enable_model_summary: false
          enable_checkpointing: false
          default_root_dir: {tmp_path}
          logger:
            class_path: lightning.pytorch.loggers.CSVLogger
            init_args: {{save_dir: {tmp_path}, name: csv, version: 0}}
        """) + CALLBACKS.replace("{tmp}", str(tmp_path)) + textwrap.dedent("""
        model:
          class_path: clidemo.Demo
        data:
          class_path: clidemo.DemoData
        """)
    (tmp_path / "config.yaml").write_text(config)
    return tmp_path / "config.yaml"


def callbacks_of(cli: LightningCLI, kind: type) -> list:
    return [cb for cb in cli.trainer.callbacks if isinstance(cb, kind)]


def test_every_callback_is_configured_from_yaml_and_fits(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    cli = LightningCLI(args=["fit", "--config", str(write_project(tmp_path))])

    first, second = callbacks_of(cli, ActivationMonitor)
    assert first.modules == ["net.0", nn.ReLU]  # a class path in YAML is a type, the rest globs
    assert (first.log_every_n_steps, first.stats, first.histogram) == (1, ("mean", "zero_fraction", "count"), False)
    assert (first.bins, first.inputs, first.stages) == ([-1.0, 0.0, 1.0], True, ("train", "validate"))
    assert first.module_names == ["net.0", "net.1"]
    assert second.modules is nn.Linear and second.module_names == ["net.0", "net.2"]
    (transform,) = callbacks_of(cli, GradientTransform)
    (extractor,) = callbacks_of(cli, FeatureExtractor)
    assert extractor.modules == "net.1" and extractor.stages == ("train",)
    (gradients,) = callbacks_of(cli, GradientMonitor)
    assert (gradients.granularity, gradients.modules, gradients.norm_threshold) == ("module", [nn.Linear], 1000.0)
    (stopper,) = callbacks_of(cli, GradientAnomalyStopping)
    assert (stopper.action, stopper.patience) == ("warn", 1)
    assert (transform.scale, transform.clip_norm) == ({"net.0": 0.5}, {"net.2": 10.0})

    got = metric_series(tmp_path / "csv" / "version_0")
    assert got["activations/net.0/count"] == {0: 64, 1: 64}
    assert got["activations/net.0.input/count"] == {0: 32, 1: 32}
    assert got["activations/net.2/count"] == {0: 8}  # the Trainer's log_every_n_steps (50)
    assert got["val_activations/net.1/count"] == {1: 2 * 64}  # where Lightning logs val figures
    assert set(got["gradients/net.0/norm"]) == {0, 1} and got["anomalies/exploding"] == {0: 0, 1: 0}
    assert cli.trainer.global_step == 2
    assert load_features(tmp_path / "features", "net.1", stage="train").shape == (16, 8)


def test_the_saved_config_reproduces_the_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    LightningCLI(args=["fit", "--config", str(write_project(tmp_path, max_steps=1))])
    saved = tmp_path / "csv" / "version_0" / "config.yaml"
    assert "Unable to serialize" not in saved.read_text()
    again = LightningCLI(args=["fit", "--config", str(saved), "--trainer.logger.init_args.version=1"])
    first, second = callbacks_of(again, ActivationMonitor)
    assert first.modules == ["net.0", nn.ReLU] and second.modules is nn.Linear
    assert first.bins == [-1.0, 0.0, 1.0] and first.stages == ("train", "validate")
    assert metric_series(tmp_path / "csv" / "version_1") == metric_series(tmp_path / "csv" / "version_0")


def test_a_bad_value_in_yaml_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_project(tmp_path)
    config.write_text(config.read_text().replace("stats: [count]", "stats: [median]"))
    with pytest.raises(ValueError, match=r"unknown stat\(s\) \['median'\]"):
        LightningCLI(args=["fit", "--config", str(config)])
    config.write_text(config.read_text().replace("stats: [median]", "stats: [count]").replace(
        'modules: "net.1"', 'modules: "net.l"'))
    with pytest.raises(ValueError, match=r"pattern 'net.l' matched no module\. Did you mean: .*'net.1'"):
        LightningCLI(args=["fit", "--config", str(config)])
    assert not (tmp_path / "csv" / "version_0" / "metrics.csv").exists()


@pytest.mark.slow
def test_the_command_line(tmp_path):
    config = write_project(tmp_path)
    (tmp_path / "main.py").write_text("from lightning.pytorch.cli import LightningCLI\n\nLightningCLI()\n")
    done = subprocess.run([sys.executable, "main.py", "fit", "--config", str(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = metric_series(tmp_path / "csv" / "version_0")
    assert got["activations/net.1/count"] == {0: 64, 1: 64}
    assert 0 < got["activations/net.1/zero_fraction"][0] < 1
    assert load_features(tmp_path / "features", "net.1", stage="train").shape == (16, 8)


def test_the_standalone_package_cli_takes_the_same_callbacks(tmp_path, monkeypatch):
    from pytorch_lightning.cli import LightningCLI as StandaloneCLI

    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_project(tmp_path)
    text = config.read_text().replace("lightning.pytorch.loggers", "pytorch_lightning.loggers")
    config.write_text(text.replace("clidemo.", "clidemo_standalone."))  # a module not yet imported
    standalone = MODULE.replace("import lightning as L", "import pytorch_lightning as L")
    (tmp_path / "clidemo_standalone.py").write_text(standalone)
    cli = StandaloneCLI(args=["fit", "--config", str(config)])
    assert [type(cb).__name__ for cb in callbacks_of(cli, ActivationMonitor)] == ["ActivationMonitor"] * 2
    got = metric_series(tmp_path / "csv" / "version_0")
    assert got["activations/net.0/count"] == {0: 64, 1: 64} and got["anomalies/exploding"] == {0: 0, 1: 0}
