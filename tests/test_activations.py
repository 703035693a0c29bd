import copy
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_hooks import ActivationMonitor
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
        assert [e.step for e in series] == [0, 2, 4]
        assert all(e.histogram_value.num == 8 * width for e in series)
        assert all(sum(e.histogram_value.bucket) == 8 * width for e in series)
    steps = [e.step for e in acc.Scalars("activations/net.0/mean")]
    assert steps == [0, 2, 4]


def test_stats_equal_torch_on_the_same_input(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    initial = copy.deepcopy(model)
    data = loader()
    run = trainer(tmp_path, [ActivationMonitor(log_every_n_steps=5)], logger=CSVLogger(tmp_path), max_steps=1)
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
    assert steps == [0, 3]


def test_csv_only_and_several_loggers_get_the_scalars(tmp_path):
    loggers = [CSVLogger(tmp_path / "csv"), TensorBoardLogger(tmp_path / "tb")]
    monitor = ActivationMonitor(log_every_n_steps=2, stats=["mean", "max"], modules="net.0")
    trainer(tmp_path, [monitor], logger=loggers).fit(TinyNet(), loader())
    rows = [r for r in csv_metrics(str(tmp_path / "csv")) if r.get("activations/net.0/mean")]
    assert [int(r["step"]) for r in rows] == [0, 2, 4]
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
    monitor, counter = ActivationMonitor(log_every_n_steps=1), _HookCounter()
    trainer(tmp_path, [monitor, counter], logger=False).fit(model, loader())
    assert forward_hook_count(model) == 1
    trainer(tmp_path, [monitor, counter], logger=False, max_steps=3).fit(model, loader())
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
    ("kwargs", "error"),
    [
        (dict(stats=["mean", "median"]), r"unknown stat\(s\) \['median'\]"),
        (dict(stats="mean"), "unknown stat"),
        (dict(bins=0), "`bins` must be a positive int"),
        (dict(bins=[1.0, 0.5]), "strictly increasing"),
        (dict(log_every_n_steps=0), "`log_every_n_steps` must be a positive int"),
        (dict(stages=["test"]), "`stages` must be"),
        (dict(modules=[]), "empty list"),
        (dict(modules=3), "`modules` must be None"),
    ],
)
def test_bad_config_fails_in_the_constructor(kwargs, error):
    with pytest.raises((ValueError, TypeError), match=error):
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


def test_unlogged_steps_leave_the_buffers_untouched(tmp_path):
    class Probe(L.Callback):
        pending: list[bool] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.pending.append(monitor._blocks["train"].pending)

    monitor = ActivationMonitor(log_every_n_steps=3)
    trainer(tmp_path, [monitor, Probe()], logger=False).fit(TinyNet(), loader())
    assert Probe.pending == [False] * 6  # drained at each logged step, never filled otherwise
    assert not math.isnan(monitor._blocks["train"].rows[0, 0].item())
