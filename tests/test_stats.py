"""The pure statistics kernels, checked against torch and numpy computed directly."""

import math
import os

import numpy as np
import pytest
import torch

from lightning_hooks.measure import _binning, _native, stats
from lightning_hooks.measure.stats import (
    FLOAT32_MAX,
    N_FIELDS,
    STAT_NAMES,
    Binning,
    accumulate_,
    as_float_values,
    histogram_edges,
    iter_tensors,
    new_rows,
    reduce_rows,
    summarize,
)

NAN, INF = math.nan, math.inf
REQUIRE_NATIVE = os.environ.get("LIGHTNING_HOOKS_REQUIRE_NATIVE") == "1"


@pytest.fixture(autouse=True, params=["native", "tensor-ops", "accelerator"])
def kernel(request, monkeypatch):
    """Every test here runs against every kernel: the fused native one, the tensor-op one, and the
    accelerator one (run on the CPU here, in place of the tensor-op one)."""
    if request.param == "native":
        if _native.cstats is None and not REQUIRE_NATIVE:
            pytest.skip("the native kernel was not built (no C compiler at install time)")
        monkeypatch.setattr(_binning, "NATIVE_KERNEL", True)
    else:
        monkeypatch.setattr(_binning, "NATIVE_KERNEL", False)
    if request.param == "accelerator":
        monkeypatch.setattr(
            stats, "_accumulate_tensors_", lambda row, values, binning, calls: stats.accumulate_device_(
                row, values, binning.device_table(), calls)
        )
    return request.param


def _row(*tensors, bins=128, calls=1):
    """One stat row over ``tensors``, as a hook would fill it."""
    edges = histogram_edges(bins)
    row = new_rows(1, edges.numel() - 1)[0]
    for t in tensors:
        values = as_float_values(t)
        accumulate_(row, values, Binning(bins, values.device, values.dtype), calls)
    return row


def _summary(*tensors, **kwargs):
    return summarize(_row(*tensors, **kwargs).tolist())


def _hist(row):
    return row[N_FIELDS:]


def _bin_counts(values, edges):
    """Bin counts by plain comparisons: bin i holds edges[i] < v <= edges[i+1]; the outer bins
    also hold anything beyond the outer edges. Values are float32, and so are the edges they are
    compared with (float32(-1e-6) lands in the bin that ends at -1e-6)."""
    v = values.double()
    inner = edges[1:-1].float().double()
    counts = []
    for i in range(edges.numel() - 1):
        above = v > inner[i - 1] if i > 0 else torch.ones_like(v, dtype=torch.bool)
        below = v <= inner[i] if i < inner.numel() else torch.ones_like(v, dtype=torch.bool)
        counts.append(int((above & below).sum()))
    return counts


# ---------------------------------------------------------------- moments and counts


def test_known_input_with_nan_inf_1e30_and_float32_max():
    fmax = torch.finfo(torch.float32).max
    x = torch.tensor([0.0, 1.0, -2.0, 3.5, 0.0, NAN, INF, -INF, 1e30, fmax, NAN])
    finite = x[torch.isfinite(x)].double()
    s = _summary(x)
    assert s["count"] == 11
    assert s["count_finite"] == 7
    assert s["nan_count"] == 2 and s["posinf_count"] == 1 and s["neginf_count"] == 1
    assert s["nonfinite_fraction"] == pytest.approx(4 / 11)
    assert s["zero_fraction"] == pytest.approx(2 / 11)
    assert s["min"] == -2.0
    assert s["max"] == fmax and s["abs_max"] == fmax
    assert s["mean"] == pytest.approx(float(finite.mean()), rel=1e-6)
    assert s["std"] == pytest.approx(float(finite.std()), rel=1e-6)
    assert math.isfinite(s["sum_sq"])  # squares of float32 max do not overflow
    assert s["sum_sq"] == pytest.approx(float(finite.square().sum()), rel=1e-6)
    assert s["calls"] == 1


@pytest.mark.parametrize("shift", [0.0, 1.0, -5.0])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 3e3])
def test_moments_and_extremes_equal_torch(shift, scale):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4096, generator=g) * scale + shift * scale).relu_() - 0.25 * scale
    x[::7] = 0.0
    s = _summary(x)
    assert s["mean"] == pytest.approx(float(x.double().mean()), rel=1e-6, abs=1e-12)
    assert s["std"] == pytest.approx(float(x.double().std()), rel=1e-5)  # unbiased, like torch.std
    assert s["min"] == float(x.min()) and s["max"] == float(x.max())
    assert s["abs_max"] == float(x.abs().max())
    assert s["zero_fraction"] == float((x == 0).double().mean())
    assert s["count"] == x.numel() == s["count_finite"]
    assert s["nonfinite_fraction"] == 0 and s["nan_count"] == 0


@pytest.mark.parametrize("offset", [1e3, 1e4, 1e5])
def test_std_stays_accurate_when_the_mean_dwarfs_it(offset):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50_000, generator=g) + offset  # std 1: the mean is `offset` stds away from 0
    # A row keeps float64 sums of x and x**2 (they add across modules, steps and ranks), so the std
    # is sqrt((sum_sq - n * mean**2) / (n - 1)): rounding sum_sq, about n * offset**2, by half an
    # ulp alone moves the std by up to 2**-53 * offset**2 / 2 of itself (5.6e-7 at 1e5). Exact sums
    # rounded once to float64 miss by up to 9.1e-7 over 20 seeds; the kernels by up to 1.5e-6.
    # Sums in float32 would miss by 2**-24 * offset**2 / 2: 300x the std at 1e5.
    floor = 4 * 2.0**-53 * offset**2
    assert _summary(x)["std"] == pytest.approx(float(x.double().std()), rel=1e-6 + floor)


def test_sums_of_a_million_values_stay_accurate():
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(4)) * 3 + 5
    s = _summary(x)
    assert s["sum_sq"] == pytest.approx(float(x.double().square().sum()), rel=1e-6)
    assert s["std"] == pytest.approx(float(x.double().std()), rel=1e-6)


@pytest.mark.parametrize("outlier", [1e4, 1e6, -1e5])
def test_std_stays_accurate_with_an_outlier(outlier):
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(5))
    x[123] = outlier
    assert _summary(x)["std"] == pytest.approx(float(x.double().std()), rel=1e-6)


def test_a_few_finite_values_among_millions_of_nans_keep_exact_moments():
    x = torch.full((4_000_000,), NAN)
    x[1000:1007] = torch.rand(7, generator=torch.Generator().manual_seed(6))
    finite = x[1000:1007].double()
    s = _summary(x)
    assert s["mean"] == pytest.approx(float(finite.mean()), rel=1e-6)
    assert s["std"] == pytest.approx(float(finite.std()), rel=1e-6)
    assert (s["nan_count"], s["count_finite"]) == (4_000_000 - 7, 7)


def test_moments_of_several_tensors_are_those_of_their_union():
    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(n, generator=g) * (i + 1) for i, n in enumerate([5, 300, 1, 64])]
    union = torch.cat(parts).double()
    s = _summary(*parts)
    assert s["count"] == union.numel()
    assert s["calls"] == len(parts)
    assert s["mean"] == pytest.approx(float(union.mean()), rel=1e-6)
    assert s["std"] == pytest.approx(float(union.std()), rel=1e-5)
    assert (s["min"], s["max"]) == (float(union.min()), float(union.max()))


def test_calls_column_adds_what_it_is_given():
    x = torch.ones(3)
    row = _row(x, x, x, calls=0)
    assert summarize(row.tolist())["calls"] == 0
    assert summarize(row.tolist())["count"] == 9


def test_all_non_finite_gives_nan_figures_and_exact_counts():
    x = torch.tensor([NAN, INF, -INF, -INF])
    s = _summary(x)
    for stat in ("mean", "std", "min", "max", "abs_max"):
        assert math.isnan(s[stat]), stat
    assert (s["nan_count"], s["posinf_count"], s["neginf_count"]) == (1, 1, 2)
    assert s["nonfinite_fraction"] == 1.0 and s["zero_fraction"] == 0.0
    assert s["count"] == 4 and s["count_finite"] == 0
    assert _hist(_row(x)).sum() == 0


def test_one_value_has_no_std_and_no_rows_has_nothing():
    assert math.isnan(_summary(torch.tensor([2.5]))["std"])
    assert _summary(torch.tensor([2.5]))["mean"] == 2.5
    empty = summarize(new_rows(1, 4)[0].tolist())
    assert empty["count"] == 0 and empty["calls"] == 0
    assert all(math.isnan(empty[s]) for s in ("mean", "std", "min", "max", "zero_fraction"))


def test_summary_reports_every_stat_name():
    assert set(STAT_NAMES) <= set(_summary(torch.randn(10)))


# ---------------------------------------------------------------- what gets summarised


@pytest.mark.parametrize(
    ("tensor", "expected"),
    [
        (torch.tensor([[1, 2], [3, 4]]), [1.0, 2.0, 3.0, 4.0]),
        (torch.tensor([True, False, True]), [1.0, 0.0, 1.0]),
        (torch.tensor([3 + 4j, -1j]), [5.0, 1.0]),
        (torch.tensor([1.5, -2.0], dtype=torch.float16), [1.5, -2.0]),
        (torch.tensor([1.5, -2.0], dtype=torch.bfloat16), [1.5, -2.0]),
        (torch.tensor([7], dtype=torch.uint8), [7.0]),
    ],
)
def test_values_of_int_bool_complex_and_half_tensors(tensor, expected):
    values = as_float_values(tensor)
    assert values.dtype == torch.float32 and values.ndim == 1
    assert values.tolist() == expected


@pytest.mark.filterwarnings("ignore:.*(Sparse CSR|quantize).*:UserWarning")
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(0),
        lambda: torch.empty(3, 0),
        lambda: torch.eye(3).to_sparse(),
        lambda: torch.eye(3).to_sparse_csr(),
        lambda: torch.empty(4, device="meta"),
        lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8),
    ],
    ids=["empty", "empty-2d", "sparse-coo", "sparse-csr", "meta", "quantized"],
)
def test_tensors_that_are_skipped(make):
    assert as_float_values(make()) is None


def test_values_are_detached_and_keep_float64_range():
    x = torch.randn(3, requires_grad=True)
    values = as_float_values(x)
    assert not values.requires_grad
    big = torch.tensor([[1e300, -1e300], [1.0, 0.0]], dtype=torch.float64)
    assert as_float_values(big).dtype == torch.float64
    s = _summary(big)
    assert s["posinf_count"] == s["neginf_count"] == 0
    assert (s["max"], s["min"], s["count_finite"]) == (1e300, -1e300, 4)


def test_std_of_huge_values_of_opposite_sign_does_not_overflow():
    x = torch.tensor([3e38, -3e38, -3e38])
    assert _summary(x)["std"] == pytest.approx(float(x.double().std()), rel=1e-6)


def test_iter_tensors_finds_tensors_in_nested_outputs():
    from dataclasses import dataclass

    @dataclass
    class Out:
        a: torch.Tensor
        b: object

    t = [torch.full((1,), float(i)) for i in range(6)]
    value = (t[0], [t[1], {"x": t[2], "y": "text", "z": None}], Out(a=t[3], b=(t[4], 7)), {t[5]}, 3.0)
    assert [float(x) for x in iter_tensors(value)] == [0, 1, 2, 3, 4]  # sets are not walked
    assert list(iter_tensors(None)) == []
    deep: object = t[0]
    for _ in range(5000):  # far deeper than Python's recursion limit
        deep = [deep]
    assert [float(x) for x in iter_tensors(deep)] == [0]
    looped: list = [t[1], {"again": t[2]}]
    looped.append(looped)  # a list that holds itself: each tensor once
    assert [float(x) for x in iter_tensors(looped)] == [1, 2]


# ---------------------------------------------------------------- histogram


@pytest.mark.parametrize("bins", [1, 2, 3, 4, 9, 128, 129])
def test_default_edges_symmetric_increasing_and_cover_float32(bins):
    edges = histogram_edges(bins)
    assert edges.dtype == torch.float64
    assert edges.numel() == bins + 1
    assert bool((edges[1:] > edges[:-1]).all())
    assert torch.equal(edges, -edges.flip(0))
    assert edges[0] == -FLOAT32_MAX and edges[-1] == FLOAT32_MAX
    if bins % 2 == 0:
        assert edges[bins // 2] == 0  # an even count puts an edge at 0
    else:
        assert not bool((edges == 0).any())  # an odd count has a central bin around 0


def test_default_edges_are_log_spaced_between_low_and_high():
    edges = histogram_edges(10, low=1e-3, high=1e3)
    positive = edges[edges > 0]
    assert positive[0] == pytest.approx(1e-3) and positive[-2] == pytest.approx(1e3)
    ratios = positive[1:-1] / positive[:-2]
    assert torch.allclose(ratios, ratios[0].expand_as(ratios))


def test_explicit_edges_are_used_as_given():
    edges = histogram_edges([-1, 0, 0.5, 2])
    assert edges.tolist() == [-1.0, 0.0, 0.5, 2.0] and edges.dtype == torch.float64
    assert histogram_edges((0.0, 1.0)).tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(bins=0), ValueError, r"`bins` must be a positive int or a sequence of edges, got 0: pass e\.g\. bins="),
        (dict(bins=-3), ValueError, r"got -3"),
        (dict(bins=True), TypeError, r"got True \(bool\)"),
        (dict(bins=128.0), TypeError, r"got 128.0 \(float\)"),
        (dict(bins="abc"), TypeError, r"a sequence of edges, got 'abc' \(str\)"),
        (dict(bins=["a", "b"]), TypeError, r"its items must be numbers"),
        (dict(bins=[1.0]), ValueError, r">= 2 numbers, strictly increasing in float32, got \[1.0\]"),
        (dict(bins=[0.0, 1.0, 1.0]), ValueError, r"strictly increasing"),
        (dict(bins=[0.0, NAN, 1.0]), ValueError, r"strictly increasing"),
        (dict(bins=[[0.0, 1.0], [2.0, 3.0]]), ValueError, r"strictly increasing"),
        (dict(bins=[0.0, 1.0, 1.00000001]), ValueError, r"strictly increasing in float32"),
        (dict(bins=8, low=0.0), ValueError, r"0 < low < high < 3.4e38, got low=0.0"),
        (dict(bins=8, low=10.0, high=1.0), ValueError, r"got low=10.0, high=1.0"),
        (dict(bins=8, high=1e39), ValueError, r"high=1e\+39"),
    ],
)
def test_bad_edges_raise(kwargs, error, match):
    """A value of the wrong type is a TypeError, a wrong value a ValueError, as for every argument."""
    with pytest.raises(error, match=match):
        histogram_edges(**kwargs)


@pytest.mark.parametrize("bins", [2, 7, 128, 129])
def test_histogram_counts_equal_independent_binning(bins):
    g = torch.Generator().manual_seed(3)
    x = torch.cat([
        torch.randn(2000, generator=g) * 10.0 ** torch.randint(-8, 9, (2000,), generator=g),
        torch.tensor([0.0, 0.0, 1e30, -1e30, FLOAT32_MAX, -FLOAT32_MAX, 1e-6, -1e-6, 1e6]),
    ])
    edges = histogram_edges(bins)
    hist = _hist(_row(x, bins=bins))
    assert hist.tolist() == _bin_counts(x, edges)
    assert hist.sum() == x.numel()


def test_histogram_of_the_finite_part_only():
    x = torch.tensor([NAN, 0.5, INF, -3.0, -INF, NAN, 0.0, 1e30])
    edges = histogram_edges(16)
    hist = _hist(_row(x, bins=16))
    finite = x[torch.isfinite(x)]
    assert hist.tolist() == _bin_counts(finite, edges)
    assert hist.sum() == 4  # the masked values were taken back out of the zero bin
    assert (hist >= 0).all()


def test_histogram_equals_numpy_away_from_edges():
    # np.histogram bins are [a, b), ours (a, b]: they agree when no value sits on an edge.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5000, generator=g).double() * 50
    edges = histogram_edges(33)
    assert not bool(torch.isin(x, edges).any())
    counts, _ = np.histogram(x.numpy(), bins=edges.numpy())
    hist = _hist(_row(x.float(), bins=33))
    assert hist.tolist() == counts.astype(float).tolist()


def test_explicit_edges_put_values_beyond_them_in_the_outer_bins():
    x = torch.tensor([-50.0, -1.0, 0.25, 0.75, 1.0, 99.0])
    hist = _hist(_row(x, bins=[0.0, 0.5, 1.0]))
    assert hist.tolist() == [3.0, 3.0]  # (-inf, 0.5]: -50, -1, 0.25; (0.5, inf): 0.75, 1, 99


def test_zero_sits_in_the_central_bin():
    zeros = torch.zeros(5)
    assert _hist(_row(zeros, bins=4)).tolist() == [0, 5, 0, 0]  # (-1e-6, 0]
    assert _hist(_row(zeros, bins=5)).tolist() == [0, 0, 5, 0, 0]  # (-1e-6, 1e-6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zeros_and_numbers_below_the_smallest_normal_float_are_binned_like_bucketize(dtype):
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([0.0, -0.0, tiny, -tiny, tiny / 4, -tiny / 4, tiny * 4, 1e-7, -1e-7], dtype=dtype)
    binning = Binning(8, torch.device("cpu"), dtype)
    expected = torch.bucketize(x, histogram_edges(8)[1:-1].to(dtype))
    assert binning.index(x).tolist() == expected.tolist()


# ---------------------------------------------------------------- reduction across rows


def test_reduce_rows_adds_sums_and_takes_max_of_extremes():
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(100, generator=g), torch.randn(30, generator=g) * 4 + 2
    a[3] = NAN
    b[0] = -INF
    per_rank = torch.stack([_row(a), _row(b)])  # (ranks, cols)
    reduced = reduce_rows(per_rank)
    whole = _row(a, b)
    assert torch.equal(reduced[N_FIELDS:], whole[N_FIELDS:])
    got, want = summarize(reduced.tolist()), summarize(whole.tolist())
    for stat in (*(s for s in STAT_NAMES if s != "calls"), "sum", "sum_sq"):
        assert got[stat] == pytest.approx(want[stat], rel=1e-12, nan_ok=True), stat
    assert (got["calls"], want["calls"]) == (1, 2)  # one call on each rank; one process called twice
    assert got["min"] == float(torch.cat([a, b])[torch.isfinite(torch.cat([a, b]))].min())


def test_reduce_rows_works_on_blocks_of_rows():
    blocks = new_rows(3, 8, None).expand(2, 3, -1).clone()  # (ranks, rows, cols)
    blocks[0, 1] = _row(torch.tensor([1.0, 5.0]), bins=8)
    blocks[1, 1] = _row(torch.tensor([-7.0]), bins=8)
    out = reduce_rows(blocks)
    assert out.shape == (3, N_FIELDS + 8)
    s = summarize(out[1].tolist())
    assert (s["min"], s["max"], s["count"]) == (-7.0, 5.0, 3)
    assert s["calls"] == 1  # a call on each rank: calls are per rank, the most of any rank
    assert summarize(out[0].tolist())["count"] == 0
    assert math.isinf(out[0, N_FIELDS - 1]) and out[0, N_FIELDS - 1] < 0  # max columns stay -inf


@pytest.mark.parametrize("value", [0.1, 0.02, 1 / 3, 1e-5, 1e6, 3e38, -7.5])
@pytest.mark.parametrize("n", [10, 100_000])
def test_a_constant_tensor_has_zero_std_and_its_own_mean(value, n):
    s = _summary(torch.full((n,), value))
    assert s["std"] == 0.0
    assert s["mean"] == pytest.approx(float(torch.tensor(value)), rel=1e-6)



def test_a_whole_block_summarised_at_once_gives_each_rows_figures_bit_for_bit():
    from lightning_hooks.measure._stat_rows import summarize_rows

    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(1000, generator=gen) * 1e3, torch.tensor([2.5]), torch.tensor([NAN, INF, -INF]),
               torch.zeros(7), torch.tensor([1e30, -1e30, 3.0]), torch.rand(64, generator=gen).relu()]
    rows = torch.stack([_row(t) for t in tensors] + [new_rows(1, 128)[0]])  # and a row no call reached
    block = summarize_rows(rows.numpy())
    for i, row in enumerate(rows.tolist()):
        want = summarize(row)
        got = {name: block[name][i].item() for name in want}
        assert got.keys() == want.keys()
        for name in want:  # the same float, NaN where it is NaN
            assert got[name] == want[name] or (math.isnan(got[name]) and math.isnan(want[name])), (i, name)
