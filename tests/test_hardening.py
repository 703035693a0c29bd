"""ActivationMonitor under stress, through real ``Trainer.fit`` runs, with figures read back from
the logs: odd outputs, repeated calls, divergence, in-place ops, interruptions, evaluation
forwards, gradient accumulation, long runs, resuming, and torch.compile. The monitors log all of
``STAT_NAMES``: the counts are what these tests check."""

from __future__ import annotations

import copy
import gc
import math
import os
import signal
import tracemalloc
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn

from lightning_hooks import STAT_NAMES, ActivationMonitor, GradientMonitor
from tests.helpers import HookCounter, events, forward_hook_count, trainer
from tests.zoo import (
    ZOO_SILENT,
    BasicBlock,
    F,
    Hostile,
    LitNet,
    Zoo,
    metric_series,
    zoo_expected,
    zoo_loader,
)

MLP_MODULES = ["net.0", "net.1", "net.2"]


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(F, 8), nn.ReLU(), nn.Linear(8, 1))


def csv_logger(tmp_path, version: int = 0) -> CSVLogger:
    return CSVLogger(tmp_path, name="csv", version=version)


def tb_logger(tmp_path) -> TensorBoardLogger:
    return TensorBoardLogger(tmp_path, name="tb", version=0)


def series(tmp_path, version: int = 0) -> dict[str, dict[int, float]]:
    return metric_series(tmp_path / "csv" / f"version_{version}")


def histograms(acc, tag: str) -> dict:
    return {e.step: e.histogram_value for e in acc.Histograms(tag)}


class Recorder:
    """The user's own forward hook: keeps a copy of every output with the trainer's stage and step."""

    def __init__(self, model: L.LightningModule, module: nn.Module) -> None:
        self.model = model
        self.seen: list[tuple[str, int, torch.Tensor]] = []
        self.handle = module.register_forward_hook(self)

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        run = self.model._trainer
        stage = "none" if run is None else run.state.stage.value
        self.seen.append((stage, -1 if run is None else run.global_step, output.detach().clone()))

    def values(self, stage: str, step: int) -> torch.Tensor:
        return torch.cat([o.flatten() for s, st, o in self.seen if s == stage and st == step])

    def stages(self) -> set[str]:
        return {s for s, _, _ in self.seen}


# ---------------------------------------------------------------- odd outputs, repeated calls


def test_the_zoo_trains_and_every_call_and_count_is_true(tmp_path):
    torch.manual_seed(0)
    net = Zoo()
    names = [n for n, _ in net.named_modules() if n]
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1, modules=[f"net.{n}" for n in names])
    run = trainer(tmp_path, [monitor], logger=[csv_logger(tmp_path), tb_logger(tmp_path)], max_steps=2)
    run.fit(LitNet(net), zoo_loader(16, 8))

    got, expected = series(tmp_path), zoo_expected(8)
    assert set(expected) | set(ZOO_SILENT) == set(names)
    for name, (calls, count) in expected.items():
        assert got[f"activations/net.{name}/calls"] == {0: calls, 1: calls}, name
        assert got[f"activations/net.{name}/count"] == {0: count, 1: count}, name
    for name in ZOO_SILENT:  # None, sparse, empty outputs and a forward that raised: no figures
        assert not [k for k in got if k.startswith(f"activations/net.{name}/")], name
    assert got["activations/net.complex/min"][0] >= 0  # complex outputs by their magnitude
    assert got["activations/net.ints/min"][0] == 0 and got["activations/net.ints/max"][0] <= F - 1

    acc = events(str(tmp_path / "tb"))
    for name, (_, count) in expected.items():
        hist = histograms(acc, f"activations/net.{name}")
        assert sorted(hist) == [0, 1], name
        assert all(h.num == count == sum(h.bucket) for h in hist.values()), name
    assert forward_hook_count(net) == 0


def test_the_zoo_with_inputs_and_validation_never_disables_a_hook(tmp_path):
    torch.manual_seed(0)
    net = Zoo()
    # histogram=False: a CSVLogger takes none, and asking for them would (rightly) warn.
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1, inputs=True, stages=("train", "validate"),
                                histogram=False)
    run = trainer(tmp_path, [monitor], logger=csv_logger(tmp_path), max_epochs=1, max_steps=-1,
                  num_sanity_val_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(LitNet(net), zoo_loader(16, 8), zoo_loader(8, 8, seed=1))
    assert not [w for w in caught if "ActivationMonitor" in str(w.message)]
    got = series(tmp_path)
    assert got["activations/net.res.relu/calls"] == {0: 2, 1: 2}
    # The in-place ReLU overwrites its input: inputs are read before the forward, outputs after.
    assert got["activations/net.res.relu.input/min"][0] < 0 <= got["activations/net.res.relu/min"][0]
    assert got["activations/net.shared.lin.input/count"][0] == 2 * 8 * F
    assert got["val_activations/net.loop.cell/calls"] == {1: 3}  # where Lightning logs the run's val figures
    assert forward_hook_count(net) == 0


# ---------------------------------------------------------------- divergence


class Tap(nn.Module):
    """Passes its input on (as a new tensor), so the monitor sees the raw batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


def diverging_batches() -> torch.Tensor:
    """Five batches of (4, F): clean, one NaN, two +Inf and a -Inf, a row of 1e30, float32 max."""
    x = torch.randn(5, 4, F, generator=torch.Generator().manual_seed(0))
    x[1, 0, 0] = math.nan
    x[2, 1, 1] = x[2, 2, 2] = math.inf
    x[2, 3, 3] = -math.inf
    x[3, 0] = 1e30
    x[4, 1, 0] = torch.finfo(torch.float32).max
    return x


def test_a_diverging_run_keeps_logging_true_counts(tmp_path):
    x = diverging_batches()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.view(-1, F), torch.zeros(20, 1)), 4)
    net = nn.Sequential(Tap(), nn.Linear(F, F), nn.Linear(F, 1))
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1, modules=["net.0", "net.1"])
    run = trainer(tmp_path, [monitor], logger=[csv_logger(tmp_path), tb_logger(tmp_path)], max_steps=5)
    run.fit(LitNet(net), data)  # never raises

    got = series(tmp_path)
    acc = events(str(tmp_path / "tb"))
    tap = histograms(acc, "activations/net.0")
    assert sorted(tap) == [0, 1, 2, 3, 4]
    for step in range(5):
        b = x[step]
        finite = b[torch.isfinite(b)].double()
        assert got["activations/net.0/count"][step] == 16
        assert got["activations/net.0/nan_count"][step] == int(b.isnan().sum())
        assert got["activations/net.0/posinf_count"][step] == int(b.isposinf().sum())
        assert got["activations/net.0/neginf_count"][step] == int(b.isneginf().sum())
        assert got["activations/net.0/nonfinite_fraction"][step] == (16 - finite.numel()) / 16
        assert got["activations/net.0/max"][step] == float(finite.max())
        assert got["activations/net.0/mean"][step] == pytest.approx(float(finite.mean()), rel=1e-6)
        # The histogram covers the finite part, with its true extremes.
        assert tap[step].num == finite.numel() == sum(tap[step].bucket)
        assert (tap[step].min, tap[step].max) == (float(finite.min()), float(finite.max()))
    assert [got[f"activations/net.0/{s}_count"][2] for s in ("nan", "posinf", "neginf")] == [0, 2, 1]
    assert got["activations/net.0/max"][3] == pytest.approx(1e30)
    assert got["activations/net.0/max"][4] == torch.finfo(torch.float32).max

    # The NaN of step 1 poisons the loss, then the weights: the Linear's output goes all-NaN.
    assert got["activations/net.1/nan_count"][0] == 0
    assert got["activations/net.1/nan_count"][1] == F  # one row of the batch
    assert all(got["activations/net.1/nan_count"][s] == 16 for s in (2, 3, 4))
    assert all(math.isnan(got["activations/net.1/mean"][s]) for s in (2, 3, 4))
    assert sorted(histograms(acc, "activations/net.1")) == [0, 1]  # nothing finite to draw after


# ---------------------------------------------------------------- in-place ops


class ResNetish(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 2, 3, padding=1)
        self.block1, self.block2 = BasicBlock(2), BasicBlock(2)
        self.head = nn.Linear(2 * 4 * 4, 1)

    def forward(self, x):
        return self.head(self.block2(self.block1(self.stem(x))).flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x.view(-1, 1, 4, 4)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_in_place_relu_and_residual_add_train_unchanged_and_are_measured_right(tmp_path):
    def fit(callbacks, logger):
        torch.manual_seed(0)
        model = ResNetish()
        recorder = Recorder(model, model.block1.bn2)
        trainer(tmp_path, callbacks, logger=logger, max_steps=3).fit(model, zoo_loader(24, 8, features=16))
        return model, recorder

    plain, _ = fit([], False)
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1, inputs=True)
    watched, recorder = fit([monitor], csv_logger(tmp_path))
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)  # watching never changes training

    got = series(tmp_path)
    assert "block1.relu" in monitor.module_names and "block1.bn2" in monitor.module_names
    for step in range(3):
        before_add = recorder.values("train", step).double()  # bn2's output, before `out += shortcut`
        assert got["activations/block1.bn2/mean"][step] == pytest.approx(float(before_add.mean()), abs=1e-6)
        assert got["activations/block1.bn2/min"][step] == pytest.approx(float(before_add.min()))
        assert got["activations/block1.relu/calls"][step] == 2
        assert got["activations/block1.relu/count"][step] == 2 * 8 * 2 * 4 * 4
        assert got["activations/block1.relu/min"][step] == 0
        assert got["activations/block1.relu.input/min"][step] < 0
    assert forward_hook_count(watched) == 1  # only the user's recorder is left


# ---------------------------------------------------------------- lifecycle


class OnException(L.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def on_exception(self, trainer, pl_module, exception):
        self.seen.append((type(exception).__name__, forward_hook_count(pl_module)))


class Interrupted(LitNet):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


def test_hooks_removed_after_keyboard_interrupt(tmp_path):
    model = Interrupted(mlp())
    spy, monitor = OnException(), ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown ends in sys.exit(1)
            trainer(tmp_path, [spy, monitor], logger=csv_logger(tmp_path)).fit(model, zoo_loader(64, 8))
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from then on
    assert spy.seen == [("KeyboardInterrupt", 3)]  # on_exception ran, with our hooks still there
    assert forward_hook_count(model) == 0 and not monitor.is_attached
    assert sorted(series(tmp_path)["activations/net.0/count"]) == [0, 1]


class StopAt(L.Callback):
    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch_idx:
            trainer.should_stop = True


def test_hooks_removed_when_another_callback_stops_training(tmp_path):
    model = LitNet(mlp())
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1)
    trainer(tmp_path, [StopAt(2), monitor], logger=csv_logger(tmp_path), max_steps=-1,
            max_epochs=3).fit(model, zoo_loader(64, 8))
    assert model.trainer.global_step == 3
    assert sorted(series(tmp_path)["activations/net.0/count"]) == [0, 1, 2]
    assert forward_hook_count(model) == 0 and not monitor.is_attached


class WithHostile(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.hostile, self.relu = nn.Linear(F, F), Hostile(good_calls=2), nn.ReLU()
        self.head = nn.Linear(F, 1)

    def forward(self, x):
        return self.head(self.relu(self.hostile(self.lin(x))["y"]))


def test_a_hook_that_raises_warns_once_and_the_others_keep_logging(tmp_path):
    model = LitNet(WithHostile())
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1, modules=["net.lin", "net.hostile", "net.relu"])
    run = trainer(tmp_path, [monitor], logger=csv_logger(tmp_path), max_steps=6)
    with pytest.warns(UserWarning, match=r"'net.hostile' raised RuntimeError: values are not ready") as rec:
        run.fit(model, zoo_loader(48, 8))  # its output cannot be read from the third call on
    assert len([w for w in rec if "raised RuntimeError" in str(w.message)]) == 1  # once, not per step
    got = series(tmp_path)
    assert sorted(got["activations/net.hostile/count"]) == [0, 1]  # then disabled
    assert sorted(got["activations/net.lin/count"]) == list(range(6))
    assert sorted(got["activations/net.relu/count"]) == list(range(6))
    assert model.net.hostile.calls == 6 and run.global_step == 6  # training went on
    assert forward_hook_count(model) == 0


def test_copy_and_save_after_fit(tmp_path):
    model = LitNet(mlp())
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1, inputs=True)
    trainer(tmp_path, [monitor], logger=False, max_steps=2).fit(model, zoo_loader(16, 8))
    x = torch.randn(3, F)
    twin = copy.deepcopy(model)
    assert forward_hook_count(twin) == 0 and torch.equal(twin(x), model(x))
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert forward_hook_count(loaded) == 0 and torch.equal(loaded(x), model(x))


def test_second_fit_never_doubles_and_user_hooks_survive(tmp_path):
    model = LitNet(mlp())
    user = Recorder(model, model.net[0])
    user_pre = model.net[2].register_forward_pre_hook(lambda module, args: None)
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1, inputs=True, histogram=False)
    counter = HookCounter()
    for _ in range(2):
        trainer(tmp_path, [monitor, counter], logger=csv_logger(tmp_path), max_steps=2, num_sanity_val_steps=1,
                limit_val_batches=1).fit(model, zoo_loader(16, 8), zoo_loader(8, 8))
        assert forward_hook_count(model) == 2
    assert set(counter.train) == {2 + 2 * 3}  # the user's two, plus a forward and a pre-hook per module
    assert set(counter.val) == {2}  # validation is not monitored: the monitor's hooks are off
    assert len(user.seen) > 0 and user.handle.id in model.net[0]._forward_hooks
    assert user_pre.id in model.net[2]._forward_pre_hooks


# ---------------------------------------------------------------- evaluation forwards


def test_validation_sanity_check_and_predict_forwards_do_not_count(tmp_path):
    model = LitNet(mlp())
    recorder = Recorder(model, model.net[0])
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1)
    run = trainer(tmp_path, [monitor], logger=csv_logger(tmp_path), max_steps=-1, max_epochs=2,
                  num_sanity_val_steps=2, val_check_interval=2, limit_val_batches=3)
    run.fit(model, zoo_loader(32, 8), zoo_loader(40, 8, seed=1))
    assert recorder.stages() == {"sanity_check", "train", "validate"}
    got = series(tmp_path)
    assert sorted(got["activations/net.0/count"]) == list(range(8))
    for step in range(8):
        train = recorder.values("train", step).double()
        assert got["activations/net.0/count"][step] == train.numel() == 8 * 8
        assert got["activations/net.0/mean"][step] == pytest.approx(float(train.mean()), abs=1e-6)
        assert got["activations/net.0/max"][step] == float(train.max())
    assert not [k for k in got if k.startswith("val_activations")]

    before = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    run.validate(model, zoo_loader(16, 8))
    run.predict(model, zoo_loader(16, 8))
    assert {"predict"} <= recorder.stages()  # the forwards happened; nothing was counted
    assert "activations/" not in (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()[len(before):]
    assert forward_hook_count(model) == 1


def test_validation_is_logged_apart_when_asked(tmp_path):
    model = LitNet(mlp())
    recorder = Recorder(model, model.net[0])
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1, stages=("train", "validate"))
    run = trainer(tmp_path, [monitor], logger=csv_logger(tmp_path), max_steps=-1, max_epochs=2,
                  num_sanity_val_steps=2, limit_val_batches=3)
    run.fit(model, zoo_loader(32, 8), zoo_loader(40, 8, seed=1))
    got = series(tmp_path)
    # One validation run per epoch, after 4 and 8 optimizer steps, logged where Lightning logs
    # val figures (the last training batch's step: 3 and 7); 3 batches, never the sanity check.
    assert got["val_activations/net.0/calls"] == {3: 3, 7: 3}
    assert got["val_activations/net.0/count"] == {3: 3 * 8 * 8, 7: 3 * 8 * 8}
    val = torch.cat([o.flatten() for s, st, o in recorder.seen if s == "validate" and st == 4]).double()
    assert got["val_activations/net.0/mean"][3] == pytest.approx(float(val.mean()), abs=1e-6)
    assert got["activations/net.0/count"] == {s: 64 for s in range(8)}  # training unaffected


# ---------------------------------------------------------------- steps under accumulation


def test_steps_are_global_steps_under_gradient_accumulation(tmp_path):
    model = LitNet(mlp())
    recorder = Recorder(model, model.net[1])
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=2)
    run = trainer(tmp_path, [monitor], logger=[csv_logger(tmp_path), tb_logger(tmp_path)], max_steps=-1,
                  max_epochs=2, accumulate_grad_batches=2)
    run.fit(model, zoo_loader(64, 8))  # 8 batches an epoch: 4 optimizer steps an epoch
    assert run.global_step == 8
    acc = events(str(tmp_path / "tb"))
    for name in MLP_MODULES:
        assert sorted(histograms(acc, f"activations/{name}")) == [0, 1, 3, 5, 7], name
        assert sorted(e.step for e in acc.Scalars(f"activations/{name}/count")) == [0, 1, 3, 5, 7]
    got = series(tmp_path)
    hist = histograms(acc, "activations/net.1")
    for step in (0, 1, 3, 5, 7):
        both = recorder.values("train", step).double()  # the step's two micro-batches
        assert both.numel() == 2 * 8 * 8
        assert got["activations/net.1/calls"][step] == 2
        assert got["activations/net.1/count"][step] == both.numel() == hist[step].num
        assert got["activations/net.1/zero_fraction"][step] == float((both == 0).double().mean())
        assert got["activations/net.1/mean"][step] == pytest.approx(float(both.mean()), abs=1e-6)


# ---------------------------------------------------------------- memory


class MemoryProbe(L.Callback):
    """Live tensors, their bytes and all gc-tracked objects at two steps; Python allocations
    (tracemalloc) over the last ``window`` steps."""

    def __init__(self, first: int, last: int, window: int) -> None:
        self.first, self.last, self.window = first, last, window
        self.snap: dict[int, tuple[int, int, int]] = {}
        self.traced = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step in (self.first, self.last):
            gc.collect()
            objects = gc.get_objects()
            # type(), not isinstance(): that reads `__class__`, which warns on torch.distributed.reduce_op
            tensors = [o for o in objects if issubclass(type(o), torch.Tensor)]
            nbytes = sum(t.untyped_storage().nbytes() for t in tensors)
            del objects, tensors
            # Counted after reading the storages: torch keeps the Python storage object (and a weak
            # reference) that `untyped_storage()` made for as long as the storage lives, so counting
            # before would charge the first reading's objects to the steps in between.
            gc.collect()
            tensors_now = sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())
            self.snap[step] = (tensors_now, nbytes, len(gc.get_objects()))
        if step == self.last - self.window:
            gc.collect()
            tracemalloc.start()
            self.start = tracemalloc.take_snapshot()
        if step == self.last:
            gc.collect()
            diff = tracemalloc.take_snapshot().compare_to(self.start, "filename")
            tracemalloc.stop()
            self.traced = sum(d.size_diff for d in diff if d.traceback[0].filename != __file__)


@pytest.mark.slow
def test_no_memory_growth_over_many_logged_steps(tmp_path):
    """Activations and gradients logged at every one of 5,000 steps, provenance on."""
    steps = int(os.environ.get("LIGHTNING_HOOKS_MEMORY_STEPS", 5000))
    # From halfway: objects some earlier test or Lightning makes once (seen: 55 between steps 200 and
    # 5,000 in the full suite, 17 alone) are out of the count; a per-step leak still adds thousands.
    probe = MemoryProbe(first=steps // 2, last=steps, window=200)
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=1)
    gradients = GradientMonitor(log_every_n_steps=1, provenance=True, norm_threshold=1e6)
    run = trainer(tmp_path, [monitor, gradients, probe], logger=csv_logger(tmp_path), max_steps=steps)
    run.fit(LitNet(mlp()), zoo_loader(4 * steps, 4))
    (t0, b0, o0), (t1, b1, o1) = probe.snap[steps // 2], probe.snap[steps]
    assert (t1, b1) == (t0, b0)  # not one tensor, not one byte of tensor storage more
    assert o1 - o0 < 50  # gc-tracked objects: a per-step leak would add thousands
    assert probe.traced < 32 * 1024  # Python allocations over the last 200 steps
    assert len(series(tmp_path)["activations/net.0/count"]) == steps


# ---------------------------------------------------------------- resuming


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.parametrize("same_monitor", [True, False])
def test_resume_from_checkpoint_registers_once_and_continues_the_steps(tmp_path, same_monitor):
    def fit(monitor, epochs, version, ckpt_path=None):
        counter = HookCounter()
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
        run = trainer(tmp_path, [monitor, counter, checkpoint], logger=csv_logger(tmp_path, version),
                      max_steps=-1, max_epochs=epochs, enable_checkpointing=True)
        run.fit(LitNet(mlp(seed=version)), zoo_loader(32, 8), ckpt_path=ckpt_path)  # 4 steps an epoch
        return counter

    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=2)
    first = fit(monitor, 1, 0)
    second = fit(monitor if same_monitor else ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=2), 2, 1,
                 ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    # One hook per module on the logged steps (0, 1, 3; then 5, 7), none on the others.
    assert first.train == [3, 3, 0, 3] and second.train == [0, 3, 0, 3]
    assert sorted(series(tmp_path, 0)["activations/net.0/count"]) == [0, 1, 3]
    assert sorted(series(tmp_path, 1)["activations/net.0/count"]) == [5, 7]  # no step-0 point on resume

    reference = tmp_path / "reference"
    trainer(reference, [ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=2)], logger=csv_logger(reference),
            max_steps=-1, max_epochs=2).fit(LitNet(mlp()), zoo_loader(32, 8))
    straight, resumed = series(reference), series(tmp_path, 1)
    for stat in ("mean", "std", "max", "zero_fraction"):
        for step in (5, 7):
            assert resumed[f"activations/net.1/{stat}"][step] == pytest.approx(
                straight[f"activations/net.1/{stat}"][step], rel=1e-6), (stat, step)


# ---------------------------------------------------------------- torch.compile


def _compiled_run(tmp_path, backend):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    net = mlp()
    compiled = torch.compile(net, backend=backend)
    monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=2)
    trainer(tmp_path, [monitor], logger=csv_logger(tmp_path), max_steps=6).fit(LitNet(compiled), zoo_loader(64, 8))
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    return monitor, net, compiled, series(tmp_path), graphs, breaks


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])  # inductor: tests/test_compile.py has more
def test_torch_compile_gives_the_eager_figures(tmp_path, backend):
    monitor, net, compiled, got, graphs, breaks = _compiled_run(tmp_path / "compiled", backend)
    eager_monitor = ActivationMonitor(stats=STAT_NAMES, log_every_n_steps=2)
    trainer(tmp_path, [eager_monitor], logger=csv_logger(tmp_path), max_steps=6).fit(
        LitNet(mlp()), zoo_loader(64, 8))
    eager = series(tmp_path)

    assert monitor.module_names == eager_monitor.module_names == MLP_MODULES  # no '_orig_mod' in tags
    assert got["activations/net.0/count"] == {0: 64, 1: 64, 3: 64, 5: 64}  # unlogged steps were not collected
    assert got["activations/net.0/calls"] == {0: 1, 1: 1, 3: 1, 5: 1}
    for key, values in eager.items():
        if key.startswith("activations/"):
            for step, value in values.items():
                assert got[key][step] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), (key, step)
    # The hooks are traced into the graph, and the gate flag is guarded on: one graph with the
    # gate open, one with it closed, no graph breaks.
    assert (graphs, breaks) == (2, 0)
    assert forward_hook_count(net) == 0
    compiled(torch.randn(2, F))  # after fit, without our hooks: recompiles, records nothing
    assert not monitor._blocks["train"].pending
