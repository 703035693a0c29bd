"""Renamed arguments, positional calls, exports that left the top level: they work for a release, with a warning."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from lightning.fabric.utilities.rank_zero import LightningDeprecationWarning

import lightning_hooks
from lightning_hooks import (
    ActivationMonitor,
    FeatureExtractor,
    GradientAnomalyStopping,
    GradientMonitor,
    GradientTransform,
    LayerHealth,
    load_features,
)
from tests.helpers import TinyNet, loader, trainer


@pytest.mark.parametrize(
    ("make", "old", "new", "value"),
    [
        (GradientMonitor, "max_norm", "norm_threshold", 1e3),
        (GradientMonitor, "save_dir", "dirpath", "replay"),
        (GradientAnomalyStopping, "max_norm", "norm_threshold", 1e3),
        (GradientAnomalyStopping, "save_dir", "dirpath", "replay"),
        (ActivationMonitor, "max_modules", "max_rows", 7),
    ],
)
def test_an_old_argument_name_still_works_with_a_deprecation_warning(make, old, new, value):
    with pytest.warns(LightningDeprecationWarning, match=rf"{make.__name__}\(`{old}=`\) is deprecated .* 0\.3\.0:"
                                                         rf" write `{new}=` instead"):
        callback = make(**{old: value})
    assert getattr(callback, new) == value
    with pytest.warns(LightningDeprecationWarning, match=rf"{make.__name__}\.{old} is deprecated"):
        assert getattr(callback, old) == value  # the old attribute reads the new one
    with pytest.raises(TypeError, match=rf"pass `{new}` only; `{old}` is its deprecated name"):
        make(**{old: value, new: value})


def test_new_names_do_not_warn_and_the_signatures_show_only_them(recwarn):
    GradientAnomalyStopping(norm_threshold=1e3, dirpath="replay")
    ActivationMonitor(max_rows=7)
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
    for callback in (ActivationMonitor, GradientMonitor, GradientAnomalyStopping, FeatureExtractor):
        parameters = list(inspect.signature(callback).parameters.values())
        assert parameters[0].name == "modules", callback  # what LightningCLI and the docs read
        assert all(p.kind is p.KEYWORD_ONLY for p in parameters[1:]), callback
        assert not {"max_norm", "save_dir", "max_modules"} & {p.name for p in parameters}
    for callback in (LayerHealth, GradientTransform):
        assert all(p.kind is p.KEYWORD_ONLY for p in inspect.signature(callback).parameters.values())


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda: GradientMonitor(10, "module"), {"log_every_n_steps": 10, "granularity": "module"}),
        (lambda: ActivationMonitor(5, "net.*"), {"log_every_n_steps": 5, "modules": "net.*"}),
        (lambda: GradientAnomalyStopping("skip", 2), {"action": "skip", "patience": 2}),
        (lambda: LayerHealth(20), {"image_every_n_steps": 20}),
        (lambda: GradientTransform({"net.0": 0.5}), {"scale": {"net.0": 0.5}}),
        (lambda: FeatureExtractor("net.0", "features"), {"modules": "net.0", "dirpath": "features"}),
    ],
)
def test_a_call_in_the_old_positional_order_still_works_with_a_deprecation_warning(call, expected):
    with pytest.warns(LightningDeprecationWarning, match=r"by position is deprecated .* every argument after"
                                                         r" `modules` is keyword-only; write \w+\(\w+="):
        callback = call()
    assert {name: getattr(callback, name) for name in expected} == expected


def test_modules_alone_by_position_is_the_new_call_and_does_not_warn(recwarn):
    assert GradientAnomalyStopping("net.*").modules == "net.*"
    assert GradientMonitor(["net.0"]).modules == ["net.0"]
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_the_warning_points_at_the_users_line():
    with pytest.warns(LightningDeprecationWarning) as record:
        GradientMonitor(max_norm=1.0)
    assert [Path(w.filename).name for w in record] == [Path(__file__).name]


def test_stage_fit_is_now_train_and_the_old_name_still_works_end_to_end(tmp_path: Path):
    with pytest.warns(LightningDeprecationWarning, match=r"FeatureExtractor\(`stages='fit'`\) is deprecated"
                                                         r" .* write `stages='train'` instead"):
        extractor = FeatureExtractor("net.0", dirpath=tmp_path, stages=["fit", "predict"])
    assert extractor.stages == ("train", "predict")
    trainer(tmp_path, [extractor], max_steps=3).fit(TinyNet(), loader(n=24))
    assert [p.name for p in tmp_path.iterdir() if p.is_dir() and p.name != "lightning_logs"] == ["train"]
    with pytest.warns(LightningDeprecationWarning, match=r"load_features\(`stage='fit'`\) is deprecated"):
        old = load_features(tmp_path, "net.0", stage="fit")
    assert old.equal(load_features(tmp_path, "net.0", stage="train")) and old.shape == (24, 16)


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("HookCallback", "callbacks._base"),
        ("AnomalyDetector", "measure.anomalies"),
        ("GradientFigures", "measure.anomalies"),
        ("anomaly_flags", "measure.anomalies"),
        ("gradient_figures", "measure.anomalies"),
        ("histogram_edges", "measure.stats"),
    ],
)
def test_internals_left_the_top_level_but_still_import_from_it_with_a_warning(name, where):
    assert name not in lightning_hooks.__all__
    with pytest.warns(LightningDeprecationWarning, match=rf"`lightning_hooks\.{name}` is internal now .*"
                                                         rf" import it from `lightning_hooks\.{where}`"):
        found = getattr(lightning_hooks, name)
    module = __import__(f"lightning_hooks.{where}", fromlist=[name])
    assert found is getattr(module, name)


def test_the_internal_kernels_take_their_old_threshold_name_too():
    import torch

    from lightning_hooks.measure.anomalies import AnomalyDetector, anomaly_flags

    with pytest.warns(LightningDeprecationWarning, match=r"AnomalyDetector\(`max_norm=`\) is deprecated"):
        assert AnomalyDetector(max_norm=3.0).norm_threshold == 3.0
    norms, nonfinite = torch.tensor([5.0, 1.0]), torch.tensor([False, False])
    with pytest.warns(LightningDeprecationWarning, match=r"anomaly_flags\(`max_norm=`\) is deprecated"):
        old = anomaly_flags(norms, nonfinite, max_norm=2.0)
    assert old.equal(anomaly_flags(norms, nonfinite, norm_threshold=2.0)) and old[1].tolist() == [True, False]
