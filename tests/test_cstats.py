"""The fused native kernel (``_cstats.c``): built where required, used where it applies, and in
agreement with the tensor-op kernel on every column. The rest of test_stats.py runs against both."""

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_hooks.measure import _binning, _native, stats
from lightning_hooks.measure.stats import N_FIELDS, Binning, accumulate_, histogram_edges, new_rows, summarize

NAN, INF = math.nan, math.inf
THREADS = torch.get_num_threads()
needs_native = pytest.mark.skipif(_native.cstats is None, reason="the native kernel was not built")


def _row(x, bins, native):
    binning = Binning(bins, torch.device("cpu"), torch.float32)
    assert (binning.native is not None) == native
    row = new_rows(1, binning.n_bins)[0]
    accumulate_(row, x, binning)
    return row


SUMS = [stats._COL["sum"], stats._COL["sum_sq"]]


def _exact_columns(row):
    """Every column but the two sums: counts, extremes and histogram bins, which kernels must match."""
    return row[[i for i in range(len(row)) if i not in SUMS]].tolist()


def _assert_same_figures(a, b):
    """The same counts, extremes and bins, and sums equal to float64 rounding."""
    assert _exact_columns(a) == _exact_columns(b)
    assert a[SUMS].tolist() == pytest.approx(b[SUMS].tolist(), rel=1e-12)


def test_native_kernel_is_built_where_required():
    # CI sets LIGHTNING_HOOKS_REQUIRE_NATIVE=1: a failed build must not pass as the slow path.
    if os.environ.get("LIGHTNING_HOOKS_REQUIRE_NATIVE") != "1":
        pytest.skip("set LIGHTNING_HOOKS_REQUIRE_NATIVE=1 to require the native kernel")
    assert _native.cstats is not None
    assert stats.NATIVE_KERNEL


@needs_native
def test_used_only_for_float32_on_cpu_and_can_be_switched_off(monkeypatch):
    assert Binning(16, torch.device("cpu"), torch.float32).native is not None
    assert Binning(16, torch.device("cpu"), torch.float64).native is None
    monkeypatch.setattr(_binning, "NATIVE_KERNEL", False)
    assert Binning(16, torch.device("cpu"), torch.float32).native is None


@pytest.fixture(params=["avx2", "baseline"])
def passes(request):
    """Each test that takes this runs with the AVX2 passes (where the CPU has AVX2) and without."""
    before = _native.cstats.set_avx2(request.param == "avx2")
    yield request.param
    _native.cstats.set_avx2(before)


@needs_native
@pytest.mark.parametrize("bins", [1, 2, 7, 128, 129, [-2.0, -1e-3, 0.0, 1e-20, 5.0], [0.0, 1.0]])
def test_agrees_with_tensor_ops_at_and_around_every_edge(bins, passes, monkeypatch):
    edges = histogram_edges(bins).float()
    g = torch.Generator().manual_seed(11)
    x = torch.cat([
        edges, edges.nextafter(torch.tensor(INF)), edges.nextafter(torch.tensor(-INF)),
        torch.randn(3000, generator=g) * 10.0 ** torch.randint(-40, 38, (3000,), generator=g),
        torch.tensor([0.0, -0.0, 1e-45, -1e-45, NAN, INF, -INF, 7.0]),
    ])
    native_row = _row(x, bins, native=True)
    monkeypatch.setattr(_binning, "NATIVE_KERNEL", False)
    tensor_row = _row(x, bins, native=False)
    assert native_row[N_FIELDS:].tolist() == tensor_row[N_FIELDS:].tolist()
    assert _exact_columns(native_row) == _exact_columns(tensor_row)
    # Sums up to float32 rounding of the tensor-op kernel, relative to the sums of magnitudes.
    finite = x[x.isfinite()].double()
    scale = torch.stack([finite.abs().sum(), finite.square().sum()]).tolist()
    for i, s in zip(SUMS, scale):
        assert float(native_row[i]) == pytest.approx(float(tensor_row[i]), abs=1e-6 * s)


@needs_native
def test_non_contiguous_values_take_the_tensor_op_path_with_the_same_figures():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(13))[::3]
    assert not x.is_contiguous()
    binning = Binning(32, torch.device("cpu"), torch.float32)
    strided = new_rows(1, binning.n_bins)[0]
    accumulate_(strided, x, binning)
    assert strided.tolist() == pytest.approx(_row(x.contiguous(), 32, native=True).tolist(), rel=1e-6)


@needs_native
def test_sums_are_exact_to_float64_rounding(passes):
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(12)) * 3 + 1e3
    values = x.double().tolist()
    s = summarize(_row(x, 128, native=True).tolist())
    assert s["sum"] == pytest.approx(math.fsum(values), rel=1e-13)
    assert s["sum_sq"] == pytest.approx(math.fsum(v * v for v in values), rel=1e-13)


@needs_native
def test_a_large_tensor_split_over_threads_gives_the_same_figures():
    g = torch.Generator().manual_seed(14)
    x = torch.randn(1_000_003, generator=g) * 10.0 ** torch.randint(-8, 8, (1_000_003,), generator=g)
    x[torch.randint(0, x.numel(), (300,), generator=g)] = torch.tensor([NAN, INF, -INF]).repeat(100)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _row(x, 128, native=True)
        torch.set_num_threads(4)
        four = _row(x, 128, native=True)
    finally:
        torch.set_num_threads(before)
    _assert_same_figures(four, one)


class _Marked(torch.Tensor):
    pass


@needs_native
def test_subclasses_and_negated_views_take_the_tensor_op_path_with_right_figures():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(15))
    expected = _row(-x, 64, native=True)
    binning = Binning(64, torch.device("cpu"), torch.float32)
    for values in (torch._neg_view(x), (-x).as_subclass(_Marked)):
        row = new_rows(1, binning.n_bins)[0]
        accumulate_(row, values, binning)
        assert row[N_FIELDS:].tolist() == expected[N_FIELDS:].tolist()
        assert row[:N_FIELDS].tolist() == pytest.approx(expected[:N_FIELDS].tolist(), rel=1e-5)


@needs_native
def test_a_row_that_does_not_fit_the_bins_is_never_written_past():
    binning = Binning(128, torch.device("cpu"), torch.float32)
    rows = new_rows(2, 16)
    with pytest.raises(RuntimeError):
        accumulate_(rows[0], torch.randn(100), binning)
    assert rows[1].tolist() == new_rows(1, 16)[0].tolist()
    single = new_rows(1, 128).float()[0]  # float32: the tensor-op path, right figures
    accumulate_(single, torch.ones(100), binning)
    assert summarize(single.tolist())["count"] == 100


@needs_native
def test_the_avx2_and_baseline_passes_give_the_same_figures():
    g = torch.Generator().manual_seed(16)
    x = torch.randn(100_003, generator=g) * 10.0 ** torch.randint(-30, 30, (100_003,), generator=g)
    x[::997] = NAN
    rows = []
    for avx2 in (True, False):
        before = _native.cstats.set_avx2(avx2)
        try:
            rows.append(_row(x, 128, native=True))
        finally:
            _native.cstats.set_avx2(before)
    _assert_same_figures(*rows)


def _no_tensor_ops(row, values, binning, calls):
    raise AssertionError("the tensor-op kernel ran where the C kernel applies")


@needs_native
def test_values_inside_torch_func_go_through_the_op_to_the_c_kernel(monkeypatch):
    monkeypatch.setattr(stats, "_accumulate_tensors_", _no_tensor_ops)
    binning = Binning(32, torch.device("cpu"), torch.float32)
    rows = []

    def loss(x):
        row = new_rows(1, binning.n_bins)[0]
        accumulate_(row, x.detach().reshape(-1), binning)  # a functorch wrapper: the dispatcher unwraps it
        rows.append(row)
        return x.square().sum()

    torch.func.grad(loss)(torch.arange(6.0))
    summary = summarize(rows[0].tolist())
    assert (summary["count"], summary["max"], summary["sum"]) == (6, 5.0, 15.0)


@needs_native
def test_the_op_passes_torch_library_opcheck():
    # Schema (row is the one argument written), fake implementation, and tracing by AOTAutograd.
    binning = Binning(128, torch.device("cpu"), torch.float32)
    table, right, fine = binning.native
    values = torch.randn(1000, generator=torch.Generator().manual_seed(17))
    values[::50] = NAN
    row = new_rows(1, binning.n_bins)[0]
    torch.library.opcheck(torch.ops.lightning_hooks.accumulate_f32.default, (values, row, table, right, fine, 1.0))


@needs_native
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_code_calls_the_c_kernel_as_one_op_with_the_eager_figures(backend, monkeypatch):
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setattr(stats, "_accumulate_tensors_", _no_tensor_ops)
    binning = Binning(128, torch.device("cpu"), torch.float32)
    rows = new_rows(2, binning.n_bins)

    def hook(x, i):
        y = torch.relu(x) - 0.5
        accumulate_(rows[i], y, binning)
        return y

    x = torch.randn(3000, generator=torch.Generator().manual_seed(18)) * 1e3
    x[::100] = torch.tensor([NAN, INF, -INF]).repeat(10)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(hook, backend=counter, fullgraph=True)  # fullgraph: a graph break raises
    for _ in range(2):
        compiled(x, 0)
        hook(x, 1)
    ops = [node.target for graph in counter.graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert counter.frame_count == 1
    assert ops.count(torch.ops.lightning_hooks.accumulate_f32) == 1  # the dynamo graph holds the op packet
    assert rows[0].tolist() == rows[1].tolist()  # the same kernel: every column, bit for bit
    assert summarize(rows[0].tolist())["count"] == 6000


@needs_native
def test_the_c_kernel_checks_every_buffer_and_writes_nothing_it_refuses():
    binning = Binning(16, torch.device("cpu"), torch.float32)
    table, right, fine = (t.numpy() if isinstance(t, torch.Tensor) else t for t in binning.native)
    values, row = np.ones(10, np.float32), np.zeros(N_FIELDS + binning.n_bins)
    refused = [
        ((values.astype(np.float64), row, table, right), TypeError, "`values` must hold 4-byte items of format 'f'"),
        ((values, row.astype(np.float32), table, right), TypeError, "`row` must hold 8-byte items of format 'd'"),
        ((np.ones(20, np.float32)[::2], row, table, right), TypeError, "`values` must be a C-contiguous"),
        ((values, row[:-1], table, right), ValueError, "expected a row of 11 \\+ n_bins values"),
        ((values, row, table[:-1], right), ValueError, "a table of 8192 cells"),
        ((values, memoryview(row.tobytes()), table, right), TypeError, "`row` must be a C-contiguous, writable"),
        ((values.ctypes.data, row, table, right), TypeError, "`values` must be a C-contiguous buffer"),
    ]
    for buffers, error, match in refused:
        with pytest.raises(error, match=match):
            _native.cstats.accumulate_f32(*buffers, fine, 1.0, 1)
    assert not row.any()
    _native.cstats.accumulate_f32(values, row, table, right, fine, 1.0, 1)
    assert summarize(row.tolist())["count"] == 10


@needs_native
@pytest.mark.slow  # compiles the tensor-op kernel with inductor
def test_the_cpu_time_benchmark_times_every_kernel_at_every_size_and_thread_count():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from stat_kernels import cpu_times

    rows = cpu_times([1000, 4096], [1, 2], repeats=1)
    assert [row[:3] for row in rows] == [
        (kernel, size, threads) for size in (1000, 4096) for threads in (1, 2)
        for kernel in ("C kernel", "tensor-op", "tensor-op, inductor", "accelerator (on the CPU)")
    ]
    assert all(wall > 0 and cpu >= 0 for *_, wall, cpu in rows)
    assert torch.get_num_threads() == THREADS  # restored
