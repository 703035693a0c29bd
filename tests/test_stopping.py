"""GradientAnomalyStopping: stop at the step, skip without a trace, raise, warn, resume, DDP."""

import copy
import logging
import math
import os
import subprocess
import sys
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_hooks.callbacks.gradients import GradientMonitor
from lightning_hooks.callbacks.stopping import GradientAnomalyError, GradientAnomalyStopping
from tests.grad_helpers import GradNet, GradRecorder, run_example
from tests.helpers import BARS, bar_text, forward_hook_count, loader, progress_bar, run_ddp, trainer


class Snapshots(L.Callback):
    """Parameters and optimizer state at the start of every step."""

    def __init__(self) -> None:
        self.params: dict[int, dict[str, torch.Tensor]] = {}
        self.optim: dict[int, dict[str, Any]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        self.params[step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.optim[step] = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])


def all_finite(model: nn.Module) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"action": "halt"}, r"`action` must be one of \['stop', 'skip', 'rollback', 'raise', 'warn'\], got 'halt'"),
        ({"patience": -1}, r"`patience` must be a non-negative int, got -1"),
        ({"check_finite": False}, r"nothing to check: set `check_finite=True`, or one of `norm_threshold`"),
        ({"relative_threshold": 0.5}, r"`relative_threshold` must be a finite number > 1 or None, got 0.5"),
        ({"window": 0}, r"`window` must be a positive int, got 0"),
        ({"modules": ""}, r"`modules` holds an empty pattern"),
        ({"dirpath": ""}, r"`dirpath` is empty: pass a directory, or None to save nothing"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientAnomalyStopping(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"provenance": "yes"}, r"`provenance` must be a bool, got 'yes'"),
        ({"prog_bar": 1}, r"`prog_bar` must be a bool, got 1"),
        ({"patience": 1.5}, r"`patience` must be a non-negative int, got 1.5 \(float\)"),
        ({"action": None}, r"`action` must be one of \['stop', 'skip', 'rollback', 'raise', 'warn'\], got None"),
        ({"dirpath": 3}, r"`dirpath` must be a directory path or None, got 3"),
    ],
)
def test_arguments_of_the_wrong_type_fail_at_construction(kwargs, match):
    with pytest.raises(TypeError, match=match):
        GradientAnomalyStopping(**kwargs)


@pytest.mark.parametrize("patience", [0, 2])
def test_an_exploding_run_stops_patience_steps_after_the_first_bad_gradient(tmp_path, patience):
    torch.manual_seed(0)
    recorder = GradRecorder()
    stopper = GradientAnomalyStopping(patience=patience, norm_threshold=1e3, act_late=False)
    model = GradNet(lr=0.5, act=nn.Identity)
    fit = trainer(tmp_path, [recorder, stopper], logger=False, max_steps=50)
    fit.fit(model, loader())
    bad = [step for step, norm in sorted(recorder.total.items()) if not norm <= 1e3]
    first = bad[0]
    assert bad == list(range(first, first + patience + 1))  # consecutive, and nothing after
    assert fit.global_step == first + patience + 1
    assert stopper.last_report.step == first + patience and stopper.last_report.flags[0] in (
        "exploding", "nonfinite",
    )
    assert stopper.dropped_steps == 1
    if patience == 0:
        assert all_finite(model)  # the exploding update was never applied


def test_a_nan_in_a_named_layer_stops_the_run_and_the_report_names_the_layer(tmp_path):
    torch.manual_seed(0)
    stopper = GradientAnomalyStopping(provenance=True, dirpath=str(tmp_path))
    model = GradNet(nan_steps=(4,))
    fit = trainer(tmp_path, [stopper], logger=False, max_steps=20)
    fit.fit(model, loader())
    report = stopper.last_report
    assert fit.global_step == 5 and (report.step, report.epoch, report.batch_idx) == (4, 0, 4)
    assert report.flags == ("nonfinite",) and report.first_nonfinite_module == "net.2"
    assert "net.0.weight" in report.nonfinite_params and os.path.exists(report.saved_path)
    assert all_finite(model) and forward_hook_count(model) == 0


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_skip_leaves_parameters_and_optimizer_state_bit_identical_and_trains_on(tmp_path, precision):
    torch.manual_seed(0)
    snapshots = Snapshots()
    stopper = GradientAnomalyStopping(action="skip")
    fit = trainer(tmp_path, [snapshots, stopper], logger=False, max_steps=6, precision=precision)
    fit.fit(GradNet(optimizer="adam", nan_steps=(3,)), loader())
    assert fit.global_step == 6 and stopper.dropped_steps == 1 and stopper.anomalous_steps == 1
    for name, before in snapshots.params[3].items():
        assert torch.equal(before, snapshots.params[4][name])  # step 3 was skipped
        assert not torch.equal(snapshots.params[4][name], snapshots.params[5][name])  # step 4 was not
    for index, state in snapshots.optim[3].items():
        for key, value in state.items():
            assert torch.equal(value, snapshots.optim[4][index][key]), (index, key)


def test_raise_raises_before_the_update_with_the_report(tmp_path):
    torch.manual_seed(0)
    model = GradNet(nan_steps=(2,))
    stopper = GradientAnomalyStopping(action="raise", provenance=True)
    with pytest.raises(GradientAnomalyError, match="Gradient anomaly at step 2") as info:
        trainer(tmp_path, [stopper], logger=False, max_steps=20).fit(model, loader())
    assert isinstance(info.value, RuntimeError) and info.value.report is stopper.last_report
    assert info.value.report.first_nonfinite_module == "net.2"
    assert all_finite(model) and forward_hook_count(model) == 0


def test_warn_logs_the_report_once_per_run_of_bad_steps_through_logging_and_trains_on(tmp_path, caplog):
    torch.manual_seed(0)
    stopper = GradientAnomalyStopping(action="warn", patience=1)
    with caplog.at_level(logging.INFO, logger="lightning_hooks"), warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        fit = trainer(tmp_path, [stopper], logger=False, max_steps=6)
        fit.fit(GradNet(nan_steps=(2,)), loader())
    assert fit.global_step == 6 and stopper.anomalous_steps == 4 and stopper.dropped_steps == 0
    (report,) = [r for r in caplog.records if "Gradient anomaly" in r.getMessage()]
    assert report.name == "lightning_hooks.callbacks.stopping" and report.levelno == logging.WARNING
    assert report.getMessage().startswith("GradientAnomalyStopping: training on.\nGradient anomaly at step 3")
    assert not [w for w in raised if "anomaly" in str(w.message)]  # a log record, not a warning with a source path


_FIRST_RUN = """
from tests.grad_helpers import GradNet
from tests.helpers import loader, trainer
from lightning_hooks import GradientAnomalyStopping
fit = trainer({tmp!r}, [GradientAnomalyStopping(action="warn")], logger=False, max_steps=4)
fit.fit(GradNet(nan_steps=(2,)), loader())
"""


@pytest.mark.slow
def test_in_a_script_the_report_is_printed_to_stderr_once_without_a_source_path(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _FIRST_RUN.format(tmp=str(tmp_path))], capture_output=True,
                          text=True, timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("GradientAnomalyStopping: training on.\nGradient anomaly at step 2") == 1, done.stderr
    assert "stopping.py" not in done.stderr and "Warning" not in done.stderr, done.stderr[-3000:]


def test_the_reports_can_be_silenced_where_a_user_routes_logging(tmp_path, caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.ERROR, logger="lightning_hooks"):
        trainer(tmp_path, [GradientAnomalyStopping(action="warn")], logger=False, max_steps=4).fit(
            GradNet(nan_steps=(2,)), loader())
    assert "Gradient anomaly" not in caplog.text


def test_a_relative_spike_and_a_vanishing_norm_are_caught(tmp_path):
    torch.manual_seed(0)
    spike = GradientAnomalyStopping(relative_threshold=20.0, window=3, act_late=False)
    fit = trainer(tmp_path, [spike], logger=False, max_steps=20)
    fit.fit(GradNet(spike_steps=(5,)), loader())
    assert fit.global_step == 6 and spike.last_report.flags == ("exploding",)
    vanish = GradientAnomalyStopping(check_finite=False, min_norm=1e3, act_late=False)
    fit = trainer(tmp_path, [vanish], logger=False, max_steps=20)
    fit.fit(GradNet(), loader())
    assert fit.global_step == 1 and vanish.last_report.flags == ("vanishing",)


def test_amp_scaler_overflows_never_stop_the_run(tmp_path):
    torch.manual_seed(0)
    stopper = GradientAnomalyStopping()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**40))
    fit = trainer(tmp_path, [stopper], logger=False, max_steps=12, plugins=[plugin])
    fit.fit(GradNet(), loader())
    assert fit.global_step == 12 and stopper.amp_overflows > 0 and stopper.anomalous_steps == 0


def test_skip_under_16_mixed_with_a_fused_optimizer_measures_unscaled_gradients_and_skips(tmp_path):
    torch.manual_seed(0)
    recorder, snapshots = GradRecorder(), Snapshots()
    stopper = GradientAnomalyStopping(action="skip", norm_threshold=20.0)
    model = GradNet(spike_steps=(3,))
    model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=16.0))
    fit = trainer(tmp_path, [snapshots, stopper, recorder], logger=False, max_steps=6, plugins=[plugin])
    fit.fit(model, loader())
    assert fit.global_step == 6 and stopper.dropped_steps == 1 and stopper.amp_overflows == 0
    # Unscaled (16 times as much before), and step 3's seen by the recorder after the stopper.
    assert [step for step, norm in sorted(recorder.total.items()) if norm >= 20.0] == [3]
    for name, before in snapshots.params[3].items():
        assert torch.equal(before, snapshots.params[4][name])
    for index, state in snapshots.optim[3].items():
        for key, value in state.items():
            assert torch.equal(value, snapshots.optim[4][index][key]), (index, key)
    assert fit.precision_plugin.scaler.get_scale() == 16.0  # the scaler updated as usual: no backoff


@pytest.mark.parametrize("order", ["monitor first", "stopper first"])
def test_a_monitor_sees_the_dropped_step_wherever_it_is_in_callbacks(tmp_path, order):
    torch.manual_seed(0)
    snapshots, monitor = Snapshots(), GradientMonitor(log_every_n_steps=1)
    stopper = GradientAnomalyStopping(action="skip")
    callbacks = [monitor, stopper] if order == "monitor first" else [stopper, monitor]
    fit = trainer(tmp_path, [snapshots, *callbacks], logger=False, max_steps=6)
    fit.fit(GradNet(nan_steps=(3,)), loader())
    assert monitor.anomalous_steps == 1 and monitor.last_report.step == 3
    assert stopper.dropped_steps == 1
    for name, before in snapshots.params[3].items():
        assert torch.equal(before, snapshots.params[4][name])


def test_an_amp_overflow_between_two_anomalous_steps_leaves_the_streak_as_it_was(tmp_path):
    class Scaled(GradNet):
        """The loss times 100 at steps 3 and 5 (exploding), times 1e8 at step 4 (fp16 overflows)."""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            scale = {3: 100.0, 4: 1e8, 5: 100.0}.get(self.global_step, 1.0)
            return super().training_step(batch, batch_idx) * scale

    torch.manual_seed(0)
    stopper = GradientAnomalyStopping(action="skip", patience=1, norm_threshold=50.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)
    fit = trainer(tmp_path, [stopper], logger=False, max_steps=8,
                  plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    fit.fit(Scaled(lr=0.001), loader())
    assert stopper.amp_overflows == 1 and stopper.anomalous_steps == 2
    assert stopper.dropped_steps == 1 and stopper.last_report.step == 5  # the second in a row


def test_stop_works_beside_early_stopping_and_waits_for_min_steps(tmp_path):
    torch.manual_seed(0)
    stopper = GradientAnomalyStopping(act_late=False)
    early = EarlyStopping(monitor="val_loss", patience=100)
    fit = trainer(tmp_path, [stopper, early], logger=False, max_steps=20, limit_val_batches=2)
    fit.fit(GradNet(nan_steps=(3,)), loader(), loader(n=16))
    assert fit.global_step == 4 and math.isfinite(fit.callback_metrics["val_loss"])
    # Lightning trains on until min_steps (and, with min_steps, min_epochs=1: 8 steps here).
    stopper = GradientAnomalyStopping(act_late=False)
    fit = trainer(tmp_path, [stopper], logger=False, max_steps=20, min_steps=10)
    fit.fit(GradNet(nan_steps=(3,)), loader())
    assert fit.global_step == 10 and stopper.dropped_steps == 1


def test_with_check_finite_off_a_nan_gradient_counts_as_exploding(tmp_path):
    torch.manual_seed(0)
    stopper = GradientAnomalyStopping(check_finite=False, norm_threshold=1e6, act_late=False)
    fit = trainer(tmp_path, [stopper], logger=False, max_steps=20)
    model = GradNet(nan_steps=(2,))
    fit.fit(model, loader())
    assert fit.global_step == 3 and stopper.last_report.flags == ("exploding",)
    assert all_finite(model)


def test_a_finite_gradient_whose_norm_overflows_is_not_taken_for_a_nonfinite_one(tmp_path, c_pass):
    # The tensor ops: its float32 norm overflows and it is measured again before the update; the C pass: its float64
    # norm is finite.
    torch.manual_seed(0)
    stopper = GradientAnomalyStopping(act_late=False)  # NaN and Inf only
    fit = trainer(tmp_path, [stopper], logger=False, max_steps=20)
    fit.fit(GradNet(spike_steps=(3,)), loader())  # step 6: norms overflow, values up to 1.5e26; step 7: NaN
    assert fit.global_step == 8 and stopper.last_report.step == 7
    assert stopper.last_report.flags == ("nonfinite",) and math.isnan(stopper.last_report.total_norm)


@pytest.mark.parametrize(("prog_bar", "bar", "bad", "shown"), [
    (True, True, True, True), (True, True, False, False), (False, True, True, False), (True, False, True, False)])
def test_the_streak_shows_in_the_progress_bar_once_non_zero_when_asked_and_there_is_one(tmp_path, prog_bar, bar,
                                                                                          bad, shown):
    stopper = GradientAnomalyStopping(action="warn", prog_bar=prog_bar)
    fit = trainer(tmp_path, [stopper, *[progress_bar("tqdm")] * bar], logger=False, max_steps=3,
                  enable_progress_bar=bar)
    fit.fit(GradNet(nan_steps=(1,) if bad else ()), loader())
    assert ("anomaly_streak" in fit.progress_bar_metrics) is shown
    if bar and not bad:  # a healthy run's bar carries no count
        assert "anomal" not in bar_text(fit.progress_bar_callback)


@pytest.mark.parametrize("kind", BARS)
def test_the_progress_bar_keeps_the_streak_though_it_is_logged_only_when_it_changes(tmp_path, monkeypatch, kind):
    torch.manual_seed(0)
    logged = []
    original = L.LightningModule.log

    def spy(self: L.LightningModule, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if name == "anomaly_streak":
            logged.append((self.global_step, value.compute().item()))
        original(self, name, value, *args, **kwargs)

    monkeypatch.setattr(L.LightningModule, "log", spy)
    stopper = GradientAnomalyStopping(action="warn", patience=10, act_late=False)
    bar = progress_bar(kind)
    fit = trainer(tmp_path, [stopper, bar], logger=False, max_steps=6, enable_progress_bar=True)
    fit.fit(GradNet(nan_steps=(4,)), loader())  # the NaN poisons the weights: steps 4 and 5
    assert logged == [(4, 1), (5, 2)]  # nothing while it is 0 from the start
    assert fit.progress_bar_metrics["anomaly_streak"] == 2
    assert bar_text(bar) in ("anomaly_streak=2", "anomaly_streak: 2.000")  # TQDM's format, Rich's


def test_with_accumulation_the_report_names_and_saves_the_micro_batch_that_went_bad(tmp_path):
    torch.manual_seed(0)
    stopper = GradientAnomalyStopping(provenance=True, dirpath=str(tmp_path))
    data = loader(n=64, batch_size=8)
    fit = trainer(tmp_path, [stopper], logger=False, max_steps=-1, max_epochs=1, accumulate_grad_batches=4)
    fit.fit(GradNet(nan_batches=(5,)), data)  # step 1 is batches 4 to 7: a NaN in its micro-batch 1
    report = stopper.last_report
    assert (report.step, report.batch_idx, report.first_nonfinite_module) == (1, 5, "net.2")
    saved = torch.load(report.saved_path, weights_only=False)
    batches = list(data)
    assert torch.equal(saved["batch"][0], batches[5][0])
    assert [torch.equal(b[0], x) for b, (x, _) in zip(saved["batches"], batches[4:])] == [True] * 4


class StepProbe(L.Callback):
    """After the check (placed after it): nothing of the step is kept once its optimizer step is done."""

    def __init__(self, check: GradientAnomalyStopping) -> None:
        self.check, self.reports = check, {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        assert self.check._trace._calls == [] and self.check._micro_batches == []
        if self.check.last_report is not None:
            self.reports[self.check.last_report.step] = self.check.last_report


def test_each_report_names_its_own_module_and_nothing_outlives_its_step(tmp_path):
    torch.manual_seed(0)
    stopper = GradientAnomalyStopping(action="skip", provenance=True, dirpath=str(tmp_path))
    probe = StepProbe(stopper)
    trainer(tmp_path, [stopper, probe], logger=False, max_steps=6).fit(
        GradNet(nan_steps=(1,), first_nan_steps=(4,)), loader()
    )
    assert {step: r.first_nonfinite_module for step, r in probe.reports.items()} == {1: "net.2", 4: "net.0"}
    assert stopper.dropped_steps == 2


def test_two_stoppers_work_together_and_each_resumes_its_own_state(tmp_path):
    def stoppers() -> list[GradientAnomalyStopping]:
        return [GradientAnomalyStopping(action="skip"),
                GradientAnomalyStopping(action="warn", relative_threshold=50.0, window=2)]

    torch.manual_seed(0)
    first = stoppers()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    fit = trainer(tmp_path, [*first, checkpoint], logger=False, max_steps=4, enable_checkpointing=True)
    fit.fit(GradNet(nan_steps=(1,)), loader())
    assert [(s.anomalous_steps, s.dropped_steps) for s in first] == [(1, 1), (1, 0)]
    resumed = stoppers()[::-1]  # the order in `callbacks` does not matter
    fit = trainer(tmp_path, resumed, logger=False, max_steps=5, enable_checkpointing=True)
    fit.fit(GradNet(), loader(), ckpt_path=checkpoint.last_model_path or checkpoint.best_model_path)
    warn, skip = resumed
    assert (skip.anomalous_steps, skip.dropped_steps, skip.state_dict()["detector"]["seen"]) == (1, 1, {})
    assert (warn.anomalous_steps, warn.dropped_steps, warn.state_dict()["detector"]["seen"]) == (1, 0, {0: 4})


def test_state_survives_a_checkpoint_resume(tmp_path):
    torch.manual_seed(0)
    first = GradientAnomalyStopping(action="skip", relative_threshold=50.0, window=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    fit = trainer(tmp_path, [first, checkpoint], logger=False, max_steps=4, enable_checkpointing=True)
    fit.fit(GradNet(nan_steps=(1,)), loader())
    saved = first.state_dict()
    assert (saved["anomalous_steps"], saved["dropped_steps"], saved["detector"]["seen"]) == (1, 1, {0: 3})
    resumed = GradientAnomalyStopping(action="skip", relative_threshold=50.0, window=2)
    fit = trainer(tmp_path, [resumed], logger=False, max_steps=5, enable_checkpointing=True)
    fit.fit(GradNet(), loader(), ckpt_path=checkpoint.last_model_path or checkpoint.best_model_path)
    state = resumed.state_dict()
    assert (state["anomalous_steps"], state["dropped_steps"], state["detector"]["seen"]) == (1, 1, {0: 4})


def test_exploding_lr_example_stops_the_run_early(tmp_path, capsys):
    run_example("exploding_lr", str(tmp_path))
    out = capsys.readouterr().out
    assert "steps 0-5 ran, so trainer.global_step (steps counted) is 6, of 160 planned" in out
    assert "Parameters all finite after the stop (the last, NaN update was dropped): True" in out


@pytest.fixture(scope="module")
def ddp_ranks(tmp_path_factory):
    """One 2-process run of tests/_ddp_stopping.py (two fits); what each rank wrote."""
    return run_ddp("_ddp_stopping.py", tmp_path_factory.mktemp("ddp_stopping"), timeout=90)


@pytest.mark.slow
def test_ddp_a_nan_on_one_rank_stops_both_ranks_at_the_same_step(ddp_ranks):
    nan = [rank["nan"] for rank in ddp_ranks]
    assert nan[0] == nan[1]
    # Provenance is rank 1's, where the NaN began: net.4's gradients went bad first in backward.
    assert nan[0] == {"global_step": 4, "report_step": 3, "module": "net.2", "nonfinite_rank": 1,
                      "first_bad_param": "net.4.bias"}


@pytest.mark.slow
def test_ddp_a_decision_one_rank_alone_makes_is_acted_on_by_both(ddp_ranks):
    split = [rank["split"] for rank in ddp_ranks]
    for rank in split:
        assert (rank["global_step"], rank["report_step"], rank["dropped_steps"]) == (6, 3, 1)
        assert not rank["step3_applied"] and rank["step4_applied"]  # skipped on both ranks
    assert split[0]["params"] == split[1]["params"]  # so the ranks never diverged


@pytest.mark.slow
def test_ddp_each_check_is_one_all_reduce_and_one_host_transfer(ddp_ranks):
    for rank in ddp_ranks:
        calls = rank["split"]["calls"]
        assert sorted(calls) == ["0", "1", "2", "3", "4", "5"]
        for step in ("0", "1", "4", "5"):  # clean steps; step 3 builds a report as well
            assert calls[step] == {"all_reduce": 1, "cpu": 1}, (step, calls[step])
        assert calls["2"] == {"all_reduce": 2, "cpu": 2}  # rank 1 was unsure: both measured again
        # A GradientMonitor beside the stopper reads the same measurement: nothing more per step.
        monitor = rank["split"]["monitor_calls"]
        assert sorted(monitor) == sorted(calls)
        assert all(monitor[step] == {} for step in ("0", "1", "2", "4", "5")), monitor
