"""The same callbacks under both Lightning packages: ``lightning.pytorch`` and the standalone ``pytorch_lightning``."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from lightning_hooks import (
    ActivationMonitor,
    FeatureExtractor,
    GradientAnomalyStopping,
    GradientMonitor,
    GradientTransform,
    LayerHealth,
    TransformerStability,
    UpdateTransform,
)
from lightning_hooks.core._compat import callbacks_of, configure_model_overridden
from lightning_hooks.measure.stats import STAT_NAMES
from tests.compat_helpers import PACKAGES, net, package_trainer
from tests.helpers import BARS, bar_text, events, forward_hook_count, loader, progress_bar, run_ddp

HERE = os.path.dirname(os.path.abspath(__file__))
both = pytest.mark.parametrize("package", list(PACKAGES.values()), ids=list(PACKAGES))


@both
def test_every_callback_is_a_callback_of_either_package(package, tmp_path):
    callbacks = [ActivationMonitor(), GradientMonitor(), GradientAnomalyStopping(),
                 GradientTransform(scale={"net.0": 0.5}), FeatureExtractor("net.0", dirpath=str(tmp_path)),
                 LayerHealth()]
    assert all(isinstance(cb, package.Callback) for cb in callbacks)
    single = ActivationMonitor()
    assert single in package_trainer(package, tmp_path, single).callbacks  # wrapped in a list only if a Callback


@both
@pytest.mark.parametrize("kind", BARS)
def test_a_fit_writes_the_figures_to_tensorboard_and_int_counts_to_an_unpatched_bar(package, tmp_path, kind):
    torch.manual_seed(0)
    monitor, stopper = GradientMonitor(), GradientAnomalyStopping(action="warn", patience=10)
    logger = package.loggers.TensorBoardLogger(str(tmp_path), name="", version="")
    bar = progress_bar(kind, package)
    fit = package_trainer(package, tmp_path, [ActivationMonitor(stats=STAT_NAMES), monitor, stopper, bar],
                          logger=logger, enable_progress_bar=True)
    model = net(package, nan_steps=(3,))  # the NaN poisons the weights: steps 3, 4, 5
    fit.fit(model, loader())
    assert forward_hook_count(model) == 0
    acc = events(str(tmp_path))
    assert [e.step for e in acc.Histograms("activations/net.0")] == [0, 1, 2, 3]  # then all NaN: no histogram
    assert any(tag.startswith("gradients/net.0") for tag in acc.Tags()["histograms"])
    assert [e.value for e in acc.Scalars("anomalies/nonfinite")] == [0, 0, 0, 1, 1, 1]
    assert acc.Scalars("activations/net.0/count")[0].value == 8 * 16
    assert fit.progress_bar_callback is bar
    assert (fit.progress_bar_metrics["anomalies"], fit.progress_bar_metrics["anomaly_streak"]) == (3, 3)
    assert all(type(fit.progress_bar_metrics[name]) is int for name in ("anomalies", "anomaly_streak"))
    written = bar_text(bar)  # TQDM: "anomalies=3"; Rich: "anomalies: 3.000", its format for every number
    names = ("anomalies", "anomaly_streak")
    shown = {name: float(written.split(name)[1][1:].split(",")[0].split()[0]) for name in names}
    assert shown == {"anomalies": 3, "anomaly_streak": 3}, written
    assert not [name for name in vars(bar) if "lightning_hooks" in name or name == "get_metrics"]  # never patched


@both
def test_layer_health_draws_and_the_layout_is_written_with_either_packages_tensorboard_logger(package, tmp_path):
    torch.manual_seed(0)
    health = LayerHealth()
    logger = package.loggers.TensorBoardLogger(str(tmp_path), name="", version="")
    callbacks = [ActivationMonitor(), GradientMonitor(update_ratio=True), health]
    package_trainer(package, tmp_path, callbacks, logger=logger, max_steps=3).fit(net(package), loader())
    acc = events(str(tmp_path))
    assert "health/activation_histograms/net.3" in acc.Tags()["images"]
    assert "health/depth_profile/zero_fraction" in acc.Tags()["images"]
    assert health.summary().startswith("Layer health at step 2")
    (layout, *_) = acc.Tensors("custom_scalars__config__")
    assert b"activations/.*/std$" in layout.tensor_proto.string_val[0]


def gradient_callbacks():
    stopper = GradientAnomalyStopping(action="skip", relative_threshold=50.0, window=2)
    return GradientMonitor(log_every_n_steps=2), stopper


@both
def test_the_gradient_callbacks_state_survives_a_checkpoint_resume(package, tmp_path):
    torch.manual_seed(0)
    monitor, stopper = gradient_callbacks()
    checkpoint = package.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    fit = package_trainer(package, tmp_path, [monitor, stopper, checkpoint], max_steps=4, enable_checkpointing=True)
    fit.fit(net(package, nan_steps=(1,)), loader())
    assert (monitor.state_dict()["anomalies"], stopper.state_dict()["dropped_steps"]) == (1, 1)
    monitor, stopper = gradient_callbacks()
    fit = package_trainer(package, tmp_path, [monitor, stopper], max_steps=5, enable_checkpointing=True)
    fit.fit(net(package), loader(), ckpt_path=checkpoint.last_model_path or checkpoint.best_model_path)
    assert monitor.state_dict()["anomalies"] == 1
    state = stopper.state_dict()
    assert (state["anomalous_steps"], state["dropped_steps"], state["detector"]["seen"]) == (1, 1, {0: 4})


@both
def test_a_model_built_in_configure_model_is_hooked_at_fit_start(package, tmp_path):
    class Lazy(type(net(package))):
        def configure_model(self) -> None:
            self.net = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))

    assert configure_model_overridden(Lazy()) and not configure_model_overridden(net(package))
    assert not configure_model_overridden(nn.Linear(2, 2))
    monitor = ActivationMonitor(modules="net.0")
    package_trainer(package, tmp_path, [monitor], max_steps=1).fit(Lazy(), loader())
    assert monitor.module_names == ["net.0"]


@both
def test_two_monitors_of_one_class_share_a_trainer(package, tmp_path):
    # The stateless callbacks stay stateless to either Trainer, so two of a class never clash in a checkpoint.
    first, second = ActivationMonitor(modules="net.0"), ActivationMonitor(modules="net.4")
    package_trainer(package, tmp_path, [first, second, package.callbacks.ModelCheckpoint(dirpath=tmp_path)],
                    max_steps=2, enable_checkpointing=True).fit(net(package), loader())
    assert (first.module_names, second.module_names) == (["net.0"], ["net.4"])


@pytest.mark.slow
def test_callbacks_find_each_other_in_the_trainers_callbacks_by_class_or_role(tmp_path):
    from lightning_hooks.callbacks._rollback import Judges
    from lightning_hooks.output.figures import Diagnoses, FigureListener

    health, stability, monitor = LayerHealth(), TransformerStability(attention="*"), GradientMonitor()
    updates = UpdateTransform(scale={"*": 1.0})
    fit = package_trainer(PACKAGES["lightning.pytorch"], tmp_path, [monitor, health, updates, stability])
    assert callbacks_of(fit, Diagnoses) == [health, stability]  # in their order, by the role they meet
    assert callbacks_of(fit, FigureListener) == [health]
    assert callbacks_of(fit, Judges) == [updates]
    assert callbacks_of(fit, GradientMonitor) == [monitor]
    assert callbacks_of(object(), GradientMonitor) == []  # no callbacks: none found


def test_ddp_with_the_standalone_package_reduces_across_ranks_and_stops_both(tmp_path):
    ranks = run_ddp("_ddp_standalone.py", tmp_path, timeout=120)
    assert [r["global_step"] for r in ranks] == [4, 4]  # the NaN on rank 1 at step 3 stopped both
    assert [r["report"] for r in ranks] == [[3, "net.2", 1]] * 2
    assert [r["hooks_after"] for r in ranks] == [0, 0]
    acc = events(str(tmp_path))
    assert acc.Histograms("activations/net.0")[0].histogram_value.num == 2 * 4 * 16  # both ranks' batches


@pytest.mark.slow
def test_without_the_standalone_package_the_callbacks_fit_under_lightning_alone(tmp_path):
    script = """
import sys
sys.modules["pytorch_lightning"] = None  # import pytorch_lightning raises ImportError, as where it is not installed
from lightning_hooks import ActivationMonitor
from lightning_hooks.core._compat import CALLBACK_BASES, TENSORBOARD_LOGGERS
from tests.helpers import TinyNet, loader, trainer
monitor = ActivationMonitor(modules="net.0")
trainer(sys.argv[1], [monitor], max_steps=1).fit(TinyNet(), loader())
print(len(CALLBACK_BASES), len(TENSORBOARD_LOGGERS), monitor.module_names)
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(HERE))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "1 1 ['net.0']"
