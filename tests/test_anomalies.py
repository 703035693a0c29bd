"""The pure anomaly kernels, the detector's thresholds and running median, and the report."""

import math

import pytest
import torch

from lightning_hooks import AnomalyReport
from lightning_hooks.measure.anomalies import FLAG_NAMES, AnomalyDetector, anomaly_flags, gradient_figures

NAN, INF = math.nan, math.inf


def grads(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen), torch.randn(5, generator=gen)]


def flag(flags: torch.Tensor, name: str) -> list[bool]:
    return flags[FLAG_NAMES.index(name)].tolist()


def test_norms_per_gradient_per_group_and_total_match_torch():
    g = grads()
    figures = gradient_figures(g, [2, 1])
    torch.testing.assert_close(figures.norms, torch.stack([torch.linalg.vector_norm(t) for t in g]).double())
    assert figures.bad.tolist() == [False, False, False]
    expected_groups = [torch.nn.utils.get_total_norm(g[:2]), torch.nn.utils.get_total_norm(g[2:])]
    torch.testing.assert_close(figures.group_norms[:2].float(), torch.stack(expected_groups))
    torch.testing.assert_close(figures.group_norms[-1].float(), torch.nn.utils.get_total_norm(g))
    assert figures.nonfinite.tolist() == [0, 0, 0]


@pytest.mark.parametrize("exact", [True, False])
def test_nonfinite_gradients_are_counted_per_group_and_make_the_norms_nonfinite(exact, c_pass):
    g = grads()
    g[0][1, 2], g[2][0] = NAN, -INF
    figures = gradient_figures(g, [2, 1], exact=exact)
    assert figures.nonfinite.tolist() == [1, 1, 2] and figures.bad.tolist() == [True, False, True]
    assert math.isnan(figures.norms[0]) and math.isinf(figures.norms[2]) and math.isfinite(figures.norms[1])
    assert math.isnan(figures.group_norms[0]) and math.isinf(figures.group_norms[1])


def test_the_cpu_measures_with_the_c_pass_where_it_can_and_both_ways_agree(c_pass):
    g = grads()
    figures = gradient_figures(g, [2, 1])
    assert figures.exact is c_pass and figures.measured.dtype == (torch.float64 if c_pass else torch.float32)
    reference = torch.stack([torch.linalg.vector_norm(t.double()) for t in g])
    torch.testing.assert_close(figures.norms, reference, rtol=0 if c_pass else 1e-6, atol=1e-12 if c_pass else 1e-6)
    mixed = gradient_figures([g[0], g[1].double()], [2])  # a float64 gradient: the tensor ops, for all
    assert not mixed.exact


def test_a_huge_finite_gradient_whose_float32_norm_overflows_is_not_counted_nonfinite(c_pass):
    huge = torch.full((4,), 1e30)
    figures = gradient_figures([huge], [1])
    assert figures.nonfinite.tolist() == [0, 0] and figures.bad.tolist() == [False]
    if c_pass:  # float64 sums: the norm itself is right
        assert figures.norms[0].item() == pytest.approx(torch.linalg.vector_norm(huge.double()).item(), rel=1e-12)
    else:
        assert math.isinf(figures.norms[0])
    assert flag(anomaly_flags(figures.group_norms, figures.nonfinite, norm_threshold=1e3), "exploding") == [True, True]


def test_without_exact_an_overflowing_float32_norm_counts_as_nonfinite_unless_the_c_pass_measured_it(c_pass):
    huge, fine = torch.full((4,), 1e30), torch.ones(4)
    # The C pass's norms do not overflow: exact or not, nothing is counted wrongly.
    assert gradient_figures([huge, fine], [2], exact=False).bad.tolist() == [not c_pass, False]
    assert gradient_figures([huge, fine], [2], exact=True).bad.tolist() == [False, False]


def test_a_group_without_gradients_has_a_nan_norm_and_flags_nothing():
    figures = gradient_figures(grads()[:1], [0, 1])
    assert math.isnan(figures.group_norms[0]) and figures.nonfinite[0] == 0
    flags = anomaly_flags(figures.group_norms, figures.nonfinite, norm_threshold=1e-9, min_norm=1e-12)
    assert not flags[:, 0].any() and flags[FLAG_NAMES.index("exploding"), 1:].all()


def test_low_and_high_precision_gradients_are_measured_in_at_least_float32():
    half = torch.randn(1000, dtype=torch.bfloat16)
    wide = torch.randn(10, dtype=torch.float64)
    figures = gradient_figures([half, wide], [2])
    assert figures.norms[0].item() == pytest.approx(torch.linalg.vector_norm(half.float()).item(), rel=1e-6)
    assert figures.norms[1].item() == pytest.approx(torch.linalg.vector_norm(wide).item(), rel=1e-12)


def test_group_sizes_must_add_up():
    with pytest.raises(ValueError, match="must add up to the 3 gradients"):
        gradient_figures(grads(), [1, 1])
    with pytest.raises(ValueError, match="must add up"):
        gradient_figures([], [])


def test_no_gradients_at_all_give_nan_norms_that_flag_nothing():
    figures = gradient_figures([], [0, 0], device=torch.device("cpu"))
    assert figures.norms.shape == (0,) and figures.nonfinite.tolist() == [0, 0, 0]
    assert all(math.isnan(n) for n in figures.group_norms.tolist())
    assert not anomaly_flags(figures.group_norms, figures.nonfinite, norm_threshold=1.0, min_norm=0.5).any()


def test_flags_for_each_threshold():
    norms = torch.tensor([0.5, 50.0, 1e-9, 50.0], dtype=torch.float64)
    nonfinite = torch.tensor([0, 0, 0, 1])
    flags = anomaly_flags(norms, nonfinite, norm_threshold=10.0, min_norm=1e-6)
    assert flag(flags, "nonfinite") == [False, False, False, True]
    assert flag(flags, "exploding") == [False, True, False, False]  # non-finite is not also exploding
    assert flag(flags, "vanishing") == [False, False, True, False]
    assert not anomaly_flags(norms, nonfinite, check_finite=False).any()


def test_with_check_finite_off_nonfinite_gradients_count_as_exploding_when_a_norm_is_checked():
    norms = torch.tensor([NAN, INF, 0.5], dtype=torch.float64)
    nonfinite = torch.tensor([1, 1, 0])
    for kwargs in ({"norm_threshold": 1e9}, {"relative_threshold": 2.0}):  # no median yet: still flagged
        flags = anomaly_flags(norms, nonfinite, check_finite=False, min_norm=1e-3, **kwargs)
        assert flag(flags, "exploding") == [True, True, False] and not flags[0].any()
        assert flag(flags, "vanishing") == [False, False, False]


def test_relative_flag_compares_with_the_reference_and_ignores_a_missing_one():
    norms = torch.tensor([3.0, 30.0], dtype=torch.float64)
    nonfinite = torch.zeros(2, dtype=torch.long)
    reference = torch.tensor([1.0, NAN], dtype=torch.float64)
    flags = anomaly_flags(norms, nonfinite, relative_threshold=2.0, reference=reference)
    assert flag(flags, "exploding") == [True, False]
    assert not anomaly_flags(norms, nonfinite, relative_threshold=2.0).any()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"norm_threshold": 0}, r"`norm_threshold` must be a finite number > 0 or None, got 0"),
        ({"norm_threshold": math.inf}, r"`norm_threshold` must be a finite number"),
        ({"min_norm": -1.0}, r"`min_norm` must be a finite number > 0 or None, got -1.0"),
        ({"relative_threshold": 1.0}, r"`relative_threshold` must be a finite number > 1 or None, got 1.0"),
        ({"min_norm": 2.0, "norm_threshold": 1.0}, r"`min_norm` \(2.0\) must be below `norm_threshold` \(1.0\)"),
        ({"window": 0}, r"`window` must be a positive int, got 0"),
    ],
)
def test_detector_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AnomalyDetector(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [  # a TypeError for a value of the wrong type, as for every other argument (it was a ValueError)
        ({"relative_threshold": True}, r"`relative_threshold` must be a finite number > 1 or None, got True \(bool\)"),
        ({"check_finite": "yes"}, r"`check_finite` must be a bool, got 'yes' \(str\): pass check_finite=True"),
        ({"window": 2.0}, r"`window` must be a positive int, got 2.0 \(float\)"),
    ],
)
def test_detector_rejects_settings_of_the_wrong_type(kwargs, match):
    with pytest.raises(TypeError, match=match):
        AnomalyDetector(**kwargs)


def test_enabled_flags_follow_the_thresholds():
    assert AnomalyDetector().enabled_flags == ("nonfinite",)
    assert AnomalyDetector(check_finite=False, relative_threshold=3.0, min_norm=1e-8).enabled_flags == (
        "exploding", "vanishing",
    )


def test_running_median_starts_when_the_window_is_full_and_survives_a_state_dict_round_trip():
    detector = AnomalyDetector(relative_threshold=4.0, window=3)
    spike = gradient_figures([torch.full((4,), 10.0)], [1])  # norm 20
    for norm in (1.0, 5.0):
        assert not detector.flags(spike).any()  # window not full yet
        detector.remember(torch.tensor([norm, norm], dtype=torch.float64))
    detector.remember(torch.tensor([4.0, 4.0], dtype=torch.float64))  # median 4: 20 > 4 * 4
    assert flag(detector.flags(spike), "exploding") == [True, True]
    restored = AnomalyDetector(relative_threshold=4.0, window=3)
    restored.load_state_dict(detector.state_dict())
    assert flag(restored.flags(spike), "exploding") == [True, True]
    assert not restored.flags(spike, key=1).any()  # another optimizer has its own window


def test_nonfinite_norms_never_enter_the_running_median():
    detector = AnomalyDetector(check_finite=False, relative_threshold=4.0, window=3)
    for norm in (INF, INF, 1.0):  # finite gradients whose float32 norm overflowed, then a clean step
        detector.remember(torch.tensor([norm, norm], dtype=torch.float64))
    assert math.isnan(detector.state_dict()["history"][0][0, 0])
    spike = gradient_figures([torch.full((4,), 10.0)], [1])  # norm 20 > 4 * the median of the finite (1)
    assert flag(detector.flags(spike), "exploding") == [True, True]


def test_report_reads_well():
    report = AnomalyReport(
        step=7, epoch=1, batch_idx=3, flags=("nonfinite", "nonfinite/group1"), total_norm=NAN,
        group_norms=(0.5, NAN), first_nonfinite_module="net.2", nonfinite_rank=1,
        nonfinite_params=tuple(f"p{i}" for i in range(10)), largest_norms=(("net.0.weight", 0.5),),
        saved_path="/tmp/a.pt",
    )
    text = str(report)
    assert text.splitlines()[0] == "Gradient anomaly at step 7 (epoch 1, batch 3): nonfinite, nonfinite/group1"
    assert "per parameter group: 0.5, nan" in text
    assert "first non-finite output: module 'net.2' on rank 1" in text
    assert "non-finite gradients in 10 parameter(s): p0, p1" in text and "(2 more)" in text
    assert "largest gradient norms: net.0.weight 0.5" in text and "saved to /tmp/a.pt" in text


def _ops(grads: list[torch.Tensor]) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        gradient_figures(grads, [len(grads)], exact=False).group_norms.tolist()
    return sorted(e.name for e in prof.events() if e.name.startswith("aten::"))


def test_on_the_cpu_the_c_pass_reads_the_gradients_with_no_tensor_operation_per_gradient(c_pass):
    # The check's read at every step: with the C pass, the same few tensor operations for 5 or 500 gradients.
    gen = torch.Generator().manual_seed(4)
    few, many = ([torch.randn(8, 8, generator=gen) for _ in range(n)] for n in (5, 500))
    if c_pass:
        assert _ops(few) == _ops(many) and not any("foreach" in op or op == "aten::stack" for op in _ops(many))
    else:
        assert "aten::_foreach_norm" in _ops(many)
