import copy
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_hooks import STAT_NAMES, ActivationMonitor, GradientMonitor
from tests.helpers import TinyNet, csv_metrics, events, forward_hook_count, loader, trainer


def test_histograms_one_series_per_module_at_logged_steps(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    run = trainer(tmp_path, [ActivationMonitor(log_every_n_steps=2)], logger=TensorBoardLogger(tmp_path))
    run.fit(model, loader())
    acc = events(str(tmp_path))
    assert sorted(acc.Tags()["histograms"]) == ["activations/net.0", "activations/net.1", "activations/net.2"]
    for tag, width in [("activations/net.0", 16), ("activations/net.1", 16), ("activations/net.2", 1)]:
        series = acc.Histograms(tag)
        assert [e.step for e in series] == [0, 1, 3, 5]  # step 0, then Lightning's (n + 1) % 2 == 0
        assert all(e.histogram_value.num == 8 * width for e in series)
        assert all(sum(e.histogram_value.bucket) == 8 * width for e in series)
    steps = [e.step for e in acc.Scalars("activations/net.0/mean")]
    assert steps == [0, 1, 3, 5]


def test_stats_equal_torch_on_the_same_input(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    initial = copy.deepcopy(model)
    data = loader()
    monitor = ActivationMonitor(log_every_n_steps=5, stats=STAT_NAMES)
    run = trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=1)
    run.fit(model, data)
    row = csv_metrics(str(tmp_path))[0]
    x, _ = next(iter(data))
    with torch.no_grad():
        hidden = initial.net[0](x)
        relu = initial.net[1](hidden)
    for name, out in [("net.0", hidden), ("net.1", relu)]:
        expected = {
            "mean": out.mean(), "std": out.std(), "min": out.min(), "max": out.max(),
            "abs_max": out.abs().max(), "zero_fraction": (out == 0).float().mean(),
            "nonfinite_fraction": 0.0, "nan_count": 0.0, "count": out.numel(), "calls": 1.0,
        }
        for stat, value in expected.items():
            got = float(row[f"activations/{name}/{stat}"])
            assert got == pytest.approx(float(value), rel=1e-5, abs=1e-6), (name, stat)
    assert float(row["activations/net.1/zero_fraction"]) > 0.2  # the ReLU really zeroes


def test_default_interval_is_the_trainers(tmp_path):
    run = trainer(tmp_path, [ActivationMonitor()], logger=CSVLogger(tmp_path), log_every_n_steps=3)
    run.fit(TinyNet(), loader())
    steps = [int(r["step"]) for r in csv_metrics(str(tmp_path)) if r.get("activations/net.0/mean")]
    assert steps == [0, 2, 5]


class _LoggingNet(TinyNet):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


def test_our_points_share_steps_with_self_log_and_lightnings_own_callbacks(tmp_path):
    callbacks = [ActivationMonitor(modules="net.0", stats=["mean", "calls"]),
                 GradientMonitor(modules="net.0", update_ratio=True), LearningRateMonitor("step")]
    run = trainer(tmp_path, callbacks, logger=CSVLogger(tmp_path), max_steps=10, log_every_n_steps=5,
                  accumulate_grad_batches=2)
    run.fit(_LoggingNet(), loader(n=160))  # 20 batches, 10 optimizer steps
    rows = csv_metrics(str(tmp_path))

    def steps(tag):
        return sorted({int(r["step"]) for r in rows if r.get(tag)})

    assert steps("loss") == steps("lr-SGD") == [4, 9]  # Lightning logs step n when (n + 1) % 5 == 0
    for tag in ("activations/net.0/mean", "gradients/net.0.weight/norm", "updates/net.0.weight/ratio"):
        assert steps(tag) == [0, 4, 9], tag  # the same steps, and the start of training
    calls = {int(r["step"]): float(r["activations/net.0/calls"]) for r in rows if r.get("activations/net.0/calls")}
    assert calls == {0: 2, 4: 2, 9: 2}  # each holds its step's two micro-batches


def test_csv_only_and_several_loggers_get_the_scalars(tmp_path):
    loggers = [CSVLogger(tmp_path / "csv"), TensorBoardLogger(tmp_path / "tb")]
    monitor = ActivationMonitor(log_every_n_steps=2, stats=["mean", "max"], modules="net.0")
    trainer(tmp_path, [monitor], logger=loggers).fit(TinyNet(), loader())
    rows = [r for r in csv_metrics(str(tmp_path / "csv")) if r.get("activations/net.0/mean")]
    assert [int(r["step"]) for r in rows] == [0, 1, 3, 5]
    assert not any(k.endswith("/std") for k in rows[0])
    acc = events(str(tmp_path / "tb"))
    assert sorted(acc.Tags()["scalars"]) == ["activations/net.0/max", "activations/net.0/mean"]
    assert acc.Tags()["histograms"] == ["activations/net.0"]


def test_inputs_are_recorded_when_asked(tmp_path):
    monitor = ActivationMonitor(log_every_n_steps=1, modules="net.0", inputs=True, stats=["count"])
    trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=1).fit(TinyNet(), loader())
    row = csv_metrics(str(tmp_path))[0]
    assert float(row["activations/net.0.input/count"]) == 8 * 8
    assert float(row["activations/net.0/count"]) == 8 * 16


class _HookCounter(L.Callback):
    def __init__(self) -> None:
        self.during: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.during.append(forward_hook_count(pl_module))


def test_hooks_removed_after_fit_and_never_doubled_by_a_second_fit(tmp_path):
    model = TinyNet()
    model.net[0].register_forward_hook(lambda *args: None)  # the user's own hook
    monitor, counter = ActivationMonitor(log_every_n_steps=1, histogram=False), _HookCounter()
    trainer(tmp_path, [monitor, counter], logger=CSVLogger(tmp_path)).fit(model, loader())
    assert forward_hook_count(model) == 1
    trainer(tmp_path, [monitor, counter], logger=CSVLogger(tmp_path), max_steps=3).fit(model, loader())
    assert forward_hook_count(model) == 1
    assert set(counter.during) == {1 + 3}  # the user's hook plus one per module, in both fits
    assert not monitor.is_attached


class _Boom(TinyNet):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("boom in training_step")
        return super().training_step(batch, batch_idx)


def test_hooks_removed_after_an_exception_in_training_step(tmp_path):
    model = _Boom()
    run = trainer(tmp_path, [ActivationMonitor(log_every_n_steps=1)], logger=False)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        run.fit(model, loader())
    assert forward_hook_count(model) == 0


@pytest.mark.parametrize(
    ("kwargs", "kind", "error"),
    [
        (dict(stats=["mean", "median"]), ValueError, r"unknown stat\(s\) \['median'\] in `stats`; choose from"),
        (dict(stats="mean"), TypeError, r"`stats` must be a list of names, not the string 'mean'"),
        (dict(bins=0), ValueError, "`bins` must be a positive int"),
        (dict(bins=[1.0, 0.5]), ValueError, "strictly increasing"),
        (dict(bins=2.5), TypeError, r"`bins` must be a positive int or a sequence of edges, got 2.5 \(float\)"),
        (dict(bins=True), TypeError, "`bins` must be a positive int"),
        (dict(bins=["a", "b"]), TypeError, "its items must be numbers"),
        (dict(log_every_n_steps=0), ValueError, "`log_every_n_steps` must be a positive int or None, got 0: pass"),
        (dict(stages=["test"]), ValueError, r"unknown stage\(s\) \['test'\] in `stages`; choose from \['train',"),
        (dict(stages=3), TypeError, r"`stages` must be a list of names from \['train', 'validate'\], got 3 \(int\)"),
        (dict(histogram="yes"), TypeError, r"`histogram` must be a bool, got 'yes' \(str\): pass histogram=True"),
        (dict(inputs=1), TypeError, r"`inputs` must be a bool, got 1 \(int\)"),
        (dict(log_every_n_steps=True), TypeError,
         r"`log_every_n_steps` must be a positive int or None, got True \(bool"),
        (dict(modules=[]), ValueError, "empty list"),
        (dict(modules=3), TypeError, "`modules` must be None"),
        (dict(max_rows=0), ValueError, r"`max_rows` must be a positive int, or None for no limit, got 0"),
        (dict(max_rows=True), TypeError, "`max_rows` must be a positive int"),
    ],
)
def test_bad_config_fails_in_the_constructor(kwargs, kind, error):
    with pytest.raises(kind, match=error):
        ActivationMonitor(**kwargs)


class _Counting(TinyNet):
    steps = 0

    def training_step(self, batch, batch_idx):
        type(self).steps += 1
        return super().training_step(batch, batch_idx)


def test_a_pattern_matching_nothing_fails_before_training(tmp_path):
    run = trainer(tmp_path, [ActivationMonitor(modules="net.O")], logger=False)
    with pytest.raises(ValueError, match=r"pattern 'net.O' matched no module\. Did you mean: .*'net.0'") as err:
        run.fit(_Counting(), loader())
    assert "Available modules: 'net', 'net.0', 'net.1', 'net.2'" in str(err.value)
    assert _Counting.steps == 0


class _PendingProbe(L.Callback):
    """Placed before the monitor: sees its buffer as the batch left it, before any flush."""

    def __init__(self, monitor: ActivationMonitor) -> None:
        self.monitor = monitor
        self.pending: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.pending.append(self.monitor._blocks["train"].pending)


def test_unlogged_steps_leave_the_buffers_untouched(tmp_path):
    monitor = ActivationMonitor(log_every_n_steps=3)
    probe = _PendingProbe(monitor)
    trainer(tmp_path, [probe, monitor], logger=CSVLogger(tmp_path)).fit(TinyNet(), loader())
    assert probe.pending == [True, False, True, False, False, True]  # steps 0, 2 and 5


def test_a_trainer_that_logs_nothing_turns_the_monitor_off_unless_it_has_its_own_interval(tmp_path):
    quiet = ActivationMonitor()
    probe = _PendingProbe(quiet)
    trainer(tmp_path, [probe, quiet], logger=CSVLogger(tmp_path), log_every_n_steps=0).fit(TinyNet(), loader())
    assert probe.pending == [False] * 6
    own = ActivationMonitor(log_every_n_steps=3)
    probe = _PendingProbe(own)
    trainer(tmp_path, [probe, own], logger=CSVLogger(tmp_path), log_every_n_steps=0).fit(TinyNet(), loader())
    assert probe.pending == [True, False, True, False, False, True]


class _LBFGSNet(TinyNet):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=4)


def test_every_closure_evaluation_of_a_step_is_logged_at_that_step(tmp_path):
    monitor = ActivationMonitor(log_every_n_steps=2, modules="net.0", stats=["calls", "count"])
    trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=4).fit(_LBFGSNet(), loader())
    rows = [r for r in csv_metrics(str(tmp_path)) if r.get("activations/net.0/calls")]
    assert [int(r["step"]) for r in rows] == [0, 1, 3]
    calls = [float(r["activations/net.0/calls"]) for r in rows]
    assert all(2 <= c <= 5 for c in calls), calls  # LBFGS evaluates the closure up to max_iter + 1 times
    assert [float(r["activations/net.0/count"]) for r in rows] == [c * 8 * 16 for c in calls]


class _TwoOptimizers(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        for opt in (first, second):
            loss = torch.nn.functional.mse_loss(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.01), torch.optim.SGD(self.net[2].parameters(), lr=0.01)]


def test_manual_optimization_with_two_optimizers_logs_each_batch_once_at_its_step(tmp_path):
    monitor = ActivationMonitor(log_every_n_steps=2, modules="net.2", stats=["calls"])
    run = trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=8)
    run.fit(_TwoOptimizers(), loader())
    rows = [r for r in csv_metrics(str(tmp_path)) if r.get("activations/net.2/calls")]
    # Each batch makes two optimizer steps (global steps 0-7), but Lightning's loggers count
    # a batch once: steps 0-3, logged at 0, 1 and 3, each holding the batch's two calls.
    assert [(int(r["step"]), float(r["activations/net.2/calls"])) for r in rows] == [(0, 2), (1, 2), (3, 2)]


class _BuiltInConfigureModel(TinyNet):
    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.lr = 0.05

    def configure_model(self):
        if not hasattr(self, "net"):
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def test_a_model_built_in_configure_model_is_monitored(tmp_path):
    monitor = ActivationMonitor(log_every_n_steps=1, modules="net.*", stats=["count"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=2).fit(_BuiltInConfigureModel(), loader())
    assert not [w for w in caught if "the hook on" in str(w.message)]  # no hook failed
    rows = csv_metrics(str(tmp_path))
    assert [float(r["activations/net.2/count"]) for r in rows] == [8, 8]
    assert monitor.module_names == ["net.0", "net.1", "net.2"]


class _Attention(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0].view(-1, 2, 4).repeat(1, 1, 2)).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_attention_is_watched_whole_by_default(tmp_path):
    monitor = ActivationMonitor(log_every_n_steps=1, stats=["count", "calls"])
    trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=1).fit(_Attention(), loader())
    # out_proj's weights are used inside MultiheadAttention's forward, never by calling out_proj.
    assert "layer.self_attn" in monitor.module_names
    assert not any(name.startswith("layer.self_attn.") for name in monitor.module_names)
    row = csv_metrics(str(tmp_path))[0]
    assert float(row["activations/layer.self_attn/calls"]) == 1
    assert float(row["activations/layer.self_attn/count"]) == 8 * 2 * 8  # the attention output


class _Nested(torch.nn.Module):
    """Returns its input wrapped in 12 lists, and beside it a list that holds itself."""

    def forward(self, x: torch.Tensor) -> Any:
        deep: Any = x
        for _ in range(12):
            deep = [deep]
        looped: list[Any] = [x * 2]
        looped.append(looped)
        return deep, looped


class _NestedNet(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.nested = _Nested()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.nested(x)
        return super().forward(x)


def test_an_output_nested_deep_or_holding_itself_is_counted_once_per_tensor(tmp_path):
    monitor = ActivationMonitor(log_every_n_steps=1, modules="nested", stats=["count", "max"])
    trainer(tmp_path, [monitor], logger=CSVLogger(tmp_path), max_steps=1).fit(_NestedNet(), loader())
    row = csv_metrics(str(tmp_path))[0]
    x = next(iter(loader()))[0]
    assert float(row["activations/nested/count"]) == 2 * 8 * 8  # the deep tensor and the looped one, once each
    assert float(row["activations/nested/max"]) == pytest.approx(2 * x.max().item())


class FunctionalGate(TinyNet):
    """TinyNet with a ``gate`` Linear whose weight the forward uses directly (as transformers' Mamba uses
    ``dt_proj.weight``): its hooks never run."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.gate.weight


def test_a_module_whose_hooks_never_run_is_warned_about_once_and_a_model_that_runs_all_is_not(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [ActivationMonitor(log_every_n_steps=2)], logger=CSVLogger(tmp_path)).fit(
            FunctionalGate(), loader())
    silent = [str(w.message) for w in caught if "gave no figures" in str(w.message)]
    assert len(silent) == 1 and "1 of the 4 modules" in silent[0] and "'gate'" in silent[0], silent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path, [ActivationMonitor(log_every_n_steps=2)], logger=CSVLogger(tmp_path)).fit(
            TinyNet(), loader())
    assert not [w for w in caught if "gave no figures" in str(w.message)]
