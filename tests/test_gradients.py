"""GradientMonitor: true norms in the logs, once per optimizer step, flags, provenance, AMP."""

import math
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision

from lightning_hooks.callbacks.gradients import GradientMonitor
from tests.grad_helpers import GradNet, GradRecorder, run_example, spy_on_measurements
from tests.helpers import csv_metrics, events, forward_hook_count, loader, progress_bar, trainer


def logged(rows: list[dict[str, str]], tag: str) -> dict[int, float]:
    return {int(r["step"]): float(r[tag]) for r in rows if r.get(tag, "") != ""}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_every_n_steps": 0}, r"`log_every_n_steps` must be a positive int or None, got 0"),
        ({"granularity": "layer"}, r"`granularity` must be one of \['parameter', 'module'\], got 'layer'"),
        ({"stats": ["norm", "median"]}, r"unknown stat\(s\) \['median'\]"),
        ({"bins": 0}, r"`bins` must be a positive int"),
        ({"norm_threshold": -1}, r"`norm_threshold` must be a finite number > 0 or None, got -1"),
        ({"modules": []}, r"`modules` is an empty list"),
        ({"max_rows": 0}, r"`max_rows` must be a positive int, or None for no limit, got 0"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientMonitor(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_every_n_steps": True}, r"`log_every_n_steps` must be a positive int or None, got True \(bool\)"),
        ({"stats": "norm"}, r"`stats` must be a list of names, not the string 'norm' .*; write stats=\['norm'\]"),
        ({"check_finite": 1}, r"`check_finite` must be a bool, got 1 \(int\)"),
        ({"norm_threshold": "1e3"}, r"`norm_threshold` must be a finite number > 0 or None, got '1e3' \(str\)"),
        ({"histogram": "yes"}, r"`histogram` must be a bool, got 'yes'"),
        ({"prog_bar": None}, r"`prog_bar` must be a bool, got None"),
        ({"provenance": 1}, r"`provenance` must be a bool, got 1"),
        ({"dirpath": ["out"]}, r"`dirpath` must be a directory path or None, got \['out'\]"),
    ],
)
def test_arguments_of_the_wrong_type_fail_at_construction(kwargs, match):
    with pytest.raises(TypeError, match=match):
        GradientMonitor(**kwargs)


def test_logged_norms_equal_the_gradients_on_logged_steps_only(tmp_path):
    torch.manual_seed(0)
    recorder = GradRecorder()
    monitor = GradientMonitor(log_every_n_steps=2)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer(tmp_path, [recorder, monitor], logger=logger, max_steps=5).fit(GradNet(), loader())
    rows = csv_metrics(str(tmp_path))
    total = logged(rows, "gradients/total_norm")
    assert sorted(total) == [0, 1, 3]  # step 0, then Lightning's (n + 1) % 2 == 0
    for step, value in total.items():
        assert value == pytest.approx(recorder.total[step], rel=1e-6)
        for name, norm in recorder.norms[step].items():
            assert logged(rows, f"gradients/{name}/norm")[step] == pytest.approx(norm, rel=1e-6)
    assert logged(rows, "anomalies/nonfinite") == {0: 0.0, 1: 0.0, 3: 0.0}  # quiet flags: on logged steps


def test_flags_are_logged_on_logged_steps_where_one_is_raised_and_at_the_step_after(tmp_path):
    torch.manual_seed(0)
    monitor = GradientMonitor(log_every_n_steps=4, norm_threshold=100.0)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer(tmp_path, [monitor], logger=logger, max_steps=8).fit(GradNet(lr=1e-3, spike_steps=(5,)), loader())
    rows = csv_metrics(str(tmp_path))
    # Logged steps 0, 3 and 7; raised at 5; back to 0 at 6.
    assert logged(rows, "anomalies/exploding") == {0: 0.0, 3: 0.0, 5: 1.0, 6: 0.0, 7: 0.0}
    assert logged(rows, "anomalies/nonfinite") == {0: 0.0, 3: 0.0, 5: 0.0, 6: 0.0, 7: 0.0}


def test_a_finite_gradient_whose_float32_norm_overflows_is_flagged_exploding_only_measured_again_if_it_must(
    tmp_path, monkeypatch, c_pass
):
    torch.manual_seed(0)
    exact_steps = spy_on_measurements(monkeypatch, exact_only=True)
    monitor = GradientMonitor(log_every_n_steps=1, norm_threshold=1e3)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer(tmp_path, [monitor], logger=logger, max_steps=7).fit(GradNet(spike_steps=(3,)), loader())
    rows = csv_metrics(str(tmp_path))
    total = logged(rows, "gradients/total_norm")[6]  # every value finite, up to 1.5e26
    if c_pass:  # float64 sums: the norm is right, and nothing needs measuring again
        assert 1e26 < total < 1e28 and exact_steps == []
    else:  # the float32 norm overflows: the one step with an infinite norm is measured again
        assert math.isinf(total) and exact_steps == [6]
    assert [step for step, on in logged(rows, "anomalies/exploding").items() if on] == [3, 4, 5, 6]
    assert set(logged(rows, "anomalies/nonfinite").values()) == {0.0}


def test_module_granularity_norms_cover_each_module_and_histograms_reach_tensorboard(tmp_path):
    torch.manual_seed(0)
    recorder = GradRecorder()
    monitor = GradientMonitor(log_every_n_steps=1, granularity="module", stats=("norm", "nan_count"))
    logger = TensorBoardLogger(tmp_path, name="", version="")
    trainer(tmp_path, [recorder, monitor], logger=logger, max_steps=2).fit(GradNet(), loader())
    acc = events(str(tmp_path))
    for step in (0, 1):
        norms = recorder.norms[step]
        expected = math.hypot(norms["net.2.weight"], norms["net.2.bias"])
        assert acc.Scalars("gradients/net.2/norm")[step].value == pytest.approx(expected, rel=1e-5)
        assert acc.Scalars("gradients/net.2/nan_count")[step].value == 0
    histogram = acc.Histograms("gradients/net.0")[0].histogram_value
    assert histogram.num == 16 * 8 + 16
    assert "gradients/net.1" not in acc.Tags()["histograms"]  # the Tanh has no parameters


def test_several_parameter_groups_get_their_own_norms_and_flags(tmp_path):
    torch.manual_seed(0)
    recorder = GradRecorder()
    logger = CSVLogger(tmp_path, name="", version="")
    monitor = GradientMonitor(log_every_n_steps=1, norm_threshold=1e6)
    trainer(tmp_path, [recorder, monitor], logger=logger, max_steps=1).fit(GradNet(groups=True), loader())
    rows = csv_metrics(str(tmp_path))
    first = recorder.norms[0]
    assert logged(rows, "gradients/total_norm/group0")[0] == pytest.approx(
        math.hypot(first["net.0.weight"], first["net.0.bias"]), rel=1e-6
    )
    for tag in ("anomalies/exploding", "anomalies/exploding/group0", "anomalies/exploding/group1"):
        assert logged(rows, tag) == {0: 0.0}


@pytest.fixture
def measured_steps(monkeypatch) -> list[int]:
    """The global steps at which GradientMonitor measured the gradients, in order."""
    return spy_on_measurements(monkeypatch)


def test_with_gradient_accumulation_the_check_runs_once_per_optimizer_step(tmp_path, measured_steps):
    torch.manual_seed(0)
    calls = measured_steps
    recorder = GradRecorder()
    logger = CSVLogger(tmp_path, name="", version="")
    fit = trainer(tmp_path, [recorder, GradientMonitor(log_every_n_steps=1)], logger=logger,
                  accumulate_grad_batches=4, max_steps=-1, max_epochs=1)
    fit.fit(GradNet(), loader(n=64, batch_size=8))
    assert fit.global_step == 2 and calls == [0, 1] and recorder.calls == 2
    total = logged(csv_metrics(str(tmp_path)), "gradients/total_norm")
    assert total == pytest.approx(recorder.total, rel=1e-6)  # the accumulated gradients


def test_bf16_mixed_precision_on_cpu_reports_finite_figures(tmp_path):
    torch.manual_seed(0)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer(tmp_path, [GradientMonitor(log_every_n_steps=1)], logger=logger, max_steps=3,
            precision="bf16-mixed").fit(GradNet(), loader())
    rows = csv_metrics(str(tmp_path))
    values = [float(v) for r in rows for k, v in r.items() if k.startswith("gradients/") and v != ""]
    assert len(values) == 3 * 7 and all(math.isfinite(v) and v > 0 for v in values)
    assert set(logged(rows, "anomalies/nonfinite").values()) == {0.0}


def test_a_nan_in_a_named_layer_is_traced_to_it_saved_for_replay_and_counted(tmp_path):
    torch.manual_seed(0)
    monitor = GradientMonitor(log_every_n_steps=100, provenance=True, dirpath=str(tmp_path / "bad"))
    model = GradNet(nan_steps=(3,))
    logger = TensorBoardLogger(tmp_path, name="", version="")
    fit = trainer(tmp_path, [monitor, progress_bar("tqdm")], logger=logger, max_steps=6, enable_progress_bar=True)
    fit.fit(model, loader())
    report = monitor.last_report
    assert report is not None and (report.step, report.epoch, report.batch_idx) == (3, 0, 3)
    assert report.flags == ("nonfinite",) and report.first_nonfinite_module == "net.2"
    assert set(report.nonfinite_params) == {n for n, _ in model.named_parameters()}
    assert monitor.anomalous_steps == 3  # the NaN update poisoned the weights: steps 3, 4, 5
    assert fit.progress_bar_metrics["anomalies"] == 3
    assert "anomalies/report/text_summary" in events(str(tmp_path)).Tags()["tensors"]
    saved = torch.load(report.saved_path, weights_only=False)
    assert saved["report"]["step"] == 3
    replay = GradNet()
    replay.load_state_dict(saved["state_dict"])
    assert torch.isfinite(replay(saved["batch"][0])).all()
    replay.net[2].active = True
    assert torch.isnan(replay(saved["batch"][0])).all()


def test_no_hook_and_no_tensor_is_kept_after_fit(tmp_path):
    model = GradNet(nan_steps=(1,))
    monitor = GradientMonitor(provenance=True, dirpath=str(tmp_path))
    trainer(tmp_path, [monitor], logger=False, max_steps=3).fit(model, loader())
    assert forward_hook_count(model) == 0
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    assert monitor._trace._calls == [] and monitor._micro_batches == [] and monitor._traced == []


class NaNInBackwardOf(L.Callback):
    """At ``step``, the gradient flowing into ``module``'s output turns NaN (its forward stays finite)."""

    def __init__(self, module: str, step: int) -> None:
        self.module, self.step = module, step

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        def poison(module: Any, grad_output: tuple[torch.Tensor, ...]) -> Any:
            if pl_module.global_step == self.step:
                return (grad_output[0] * math.nan,)
            return None

        pl_module.get_submodule(self.module).register_full_backward_pre_hook(poison)


@pytest.mark.parametrize(
    ("poison", "first_bad"),
    [
        ({"nan_steps": (2,)}, "net.4"),  # a NaN output of net.2: backward reaches net.4 first
        (NaNInBackwardOf("net.2", 2), "net.2"),  # net.2's gradients go bad first; net.4's stay finite
    ],
)
def test_parameters_with_nonfinite_gradients_are_listed_first_bad_first(tmp_path, poison, first_bad):
    torch.manual_seed(0)
    monitor = GradientMonitor(provenance=True)
    callbacks = [monitor] if isinstance(poison, dict) else [poison, monitor]
    model = GradNet(**poison) if isinstance(poison, dict) else GradNet()
    trainer(tmp_path, callbacks, logger=False, max_steps=3).fit(model, loader())
    bad = monitor.last_report.nonfinite_params
    assert monitor.last_report.step == 2 and bad[0].startswith(first_bad + ".")
    assert bad[-2:] == ("net.0.bias", "net.0.weight")  # the first layer is the last backward reaches


def test_without_a_tensorboard_logger_no_histogram_is_computed(tmp_path):
    class Probe(L.Callback):
        blocks: list[Any] = []

        def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            self.blocks.extend(m._rows.block for m in trainer.callbacks if isinstance(m, GradientMonitor))

    csv = CSVLogger(tmp_path, name="", version="")
    monitors = [GradientMonitor(), GradientMonitor(stats=("norm", "max"))]
    trainer(tmp_path, [*monitors, Probe()], logger=csv, max_steps=1).fit(GradNet(), loader())
    assert Probe.blocks[0] is None and Probe.blocks[1] is not None  # the other stats still need rows


def test_amp_scaler_overflow_is_counted_apart_and_not_flagged(tmp_path):
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # fp16 overflows at first
    logger = CSVLogger(tmp_path, name="", version="")
    monitor = GradientMonitor(log_every_n_steps=1)
    fit = trainer(tmp_path, [monitor], logger=logger, max_steps=40,
                  plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    fit.fit(GradNet(), loader())
    rows = csv_metrics(str(tmp_path))
    overflow, nonfinite = logged(rows, "anomalies/amp_overflow"), logged(rows, "anomalies/nonfinite")
    assert overflow[0] == 1.0 and overflow[39] == 0.0  # the scaler backed off, then trained
    assert set(nonfinite.values()) == {0.0} and monitor.anomalous_steps == 0


def test_state_dict_round_trip():
    monitor = GradientMonitor(relative_threshold=3.0, window=2)
    monitor._anomalies = 4
    monitor._detector.remember(torch.tensor([1.0, 1.0], dtype=torch.float64))
    restored = GradientMonitor(relative_threshold=3.0, window=2)
    restored.load_state_dict(monitor.state_dict())
    assert restored.state_dict().keys() == {"anomalies", "detector"} and restored.anomalous_steps == 4
    history = [m.state_dict()["detector"]["history"][0] for m in (monitor, restored)]
    torch.testing.assert_close(*history, rtol=0, atol=0, equal_nan=True)


def test_two_monitors_work_together_and_each_resumes_its_own_state(tmp_path):
    def monitors() -> list[GradientMonitor]:
        return [GradientMonitor(min_norm=1e3),  # every step vanishes
                GradientMonitor(granularity="module", relative_threshold=50.0, window=2)]

    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    fit = trainer(tmp_path, [*monitors(), checkpoint], logger=False, max_steps=4, enable_checkpointing=True)
    fit.fit(GradNet(), loader())
    resumed = monitors()[::-1]  # the order in `callbacks` does not matter
    fit = trainer(tmp_path, resumed, logger=False, max_steps=5, enable_checkpointing=True)
    fit.fit(GradNet(), loader(), ckpt_path=checkpoint.best_model_path)
    relative, vanishing = resumed
    assert (vanishing.anomalous_steps, vanishing.state_dict()["detector"]["seen"]) == (5, {})
    assert (relative.anomalous_steps, relative.state_dict()["detector"]["seen"]) == (0, {0: 5})


@pytest.mark.slow
def test_vanishing_sigmoid_example_flags_the_first_parameter_group(tmp_path, capsys):
    run_example("vanishing_sigmoid", str(tmp_path))
    out = capsys.readouterr().out
    assert "anomalies/vanishing/group0     flagged on  32 of 32 steps" in out
    assert "anomalies/vanishing            flagged on   0 of 32 steps" in out


def test_with_no_flag_and_no_provenance_only_logged_steps_are_measured(tmp_path, measured_steps):
    torch.manual_seed(0)
    measured = measured_steps
    recorder = GradRecorder()
    logger = CSVLogger(tmp_path, name="", version="")
    monitor = GradientMonitor(log_every_n_steps=2, check_finite=False)
    trainer(tmp_path, [recorder, monitor], logger=logger, max_steps=5).fit(GradNet(), loader())
    total = logged(csv_metrics(str(tmp_path)), "gradients/total_norm")
    assert measured == [0, 1, 3] and total == pytest.approx({s: recorder.total[s] for s in (0, 1, 3)}, rel=1e-6)
