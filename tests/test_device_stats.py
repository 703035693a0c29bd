"""The accelerator statistics kernel: its launches per tensor and per gradient check, counted on the CPU.

Its figures are checked against the other kernels by every test of tests/test_stats.py (the
``accelerator`` parameter); here, what makes it GPU-shaped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightning_hooks.measure._device_stats import accumulate_device_
from lightning_hooks.measure.stats import Binning, new_rows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from stat_kernels import launches, per_check  # noqa: E402

SORTING_OR_SYNCING = {"aten::index_put_", "aten::bincount", "aten::sort", "aten::nonzero", "aten::item",
                      "aten::_local_scalar_dense", "aten::unique", "aten::_unique2"}


@pytest.mark.parametrize("size", [1, 1000, 300_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tensor_is_summarised_in_twelve_kernels_none_sorting_or_syncing(size, dtype):
    values = torch.randn(size, dtype=dtype, generator=torch.Generator().manual_seed(0))
    values[::7] = float("nan")
    binning = Binning(128, values.device, dtype)
    row = new_rows(1, binning.n_bins)[0]
    accumulate_device_(row, values, binning.device_table(), 1)  # tables are made at first use
    calls = launches(lambda: accumulate_device_(row, values, binning.device_table(), 1))
    assert sum(calls.values()) == 12, calls
    assert not set(calls) & SORTING_OR_SYNCING


def test_explicit_edges_with_zero_as_an_edge_get_exact_zero_counts():
    values = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 0.5, -3.0, float("inf")])
    binning = Binning([-1.0, 0.0, 1.0], values.device, values.dtype)
    row = new_rows(1, binning.n_bins)[0]
    accumulate_device_(row, values, binning.device_table(), 1)
    # Bin 0 is everything up to 0 (-3 too: outer bins reach beyond their edge), bin 1 the rest.
    assert row[-2:].tolist() == [4.0, 2.0]
    assert row[4].item() == 2.0  # exact zeros only, not the subnormals beside them
    assert row[7].item() == 0.0 and row[6].item() == 1.0  # no -Inf, one +Inf


def test_the_gradient_check_launches_as_many_kernels_for_128_parameters_as_for_8():
    (_, _, small), (_, _, large) = per_check([4, 64])
    assert small == large
