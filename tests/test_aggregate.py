"""StatBlock: the hooks' rows. Float32 CPU tensors in eager code go straight to the C kernel, with the op's figures."""

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_hooks.measure import _binning, _native, stats
from lightning_hooks.measure.aggregate import StatBlock
from lightning_hooks.measure.stats import Binning, accumulate_, as_float_values, new_rows

needs_native = pytest.mark.skipif(_native.cstats is None, reason="the native kernel was not built")


@pytest.fixture
def op_calls(monkeypatch):
    """The calls that went through the custom op (the dispatcher), counted."""
    calls = []
    through_op = stats.accumulate_native_

    def counted(*args):
        calls.append(args[0])
        through_op(*args)

    monkeypatch.setattr(stats, "accumulate_native_", counted)
    return calls


def _values(n=5000, seed=0):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    x[::97] = math.nan
    x[1::101], x[2::103], x[3::107] = math.inf, -math.inf, 0.0
    return x


def _through_op(*tensors, bins=128):
    """The row ``accumulate_`` gives each tensor's values (through the op where it applies)."""
    row = new_rows(1, Binning(bins, torch.device("cpu"), torch.float32).n_bins)[0]
    for i, tensor in enumerate(tensors):
        values = as_float_values(tensor)
        accumulate_(row, values, Binning(bins, values.device, values.dtype), 1 if i == 0 else 0)
    return row


def _through_block(*tensors, bins=128):
    block = StatBlock(["m"], bins, "cpu")
    for i, tensor in enumerate(tensors):
        assert block.add(0, tensor, 1 if i == 0 else 0)
    return block.rows[0]


@needs_native
def test_plain_float32_tensors_skip_the_dispatcher_with_the_ops_figures_bit_for_bit(op_calls):
    x, y = _values(), torch.nn.Linear(64, 64)(torch.randn(64, 64))  # y requires grad, as a module's output
    direct = _through_block(x, y, x[:7])
    assert op_calls == []
    assert direct.tolist() == _through_op(x, y, x[:7]).tolist()  # every column, NaN and -inf included


@needs_native
@pytest.mark.parametrize(("make", "through_op"), [
    (lambda x: x.view(50, 100).t(), 1),  # not contiguous: made contiguous, then the op
    (lambda x: torch._neg_view(x), 0),  # a negated view (its memory holds the values un-negated): tensor ops
])
def test_tensors_the_c_kernel_cannot_read_as_they_are_take_the_general_path(make, through_op, op_calls):
    x = _values()
    via_block = _through_block(make(x))
    assert len(op_calls) == through_op
    assert via_block.tolist() == _through_op(make(x)).tolist()
    values = make(x).reshape(-1)
    assert via_block[stats._COL["max"]] == values[values.isfinite()].max()


@needs_native
def test_other_dtypes_and_empty_tensors_take_the_general_path(op_calls):
    x = _values()
    wide, half = _through_block(x.double()), _through_block(x.half())
    assert len(op_calls) == 1  # float16 goes to float32, then through the op; float64 to the tensor-op kernel
    assert wide.tolist() == _through_op(x.double()).tolist()
    assert half.tolist() == _through_op(x.half()).tolist()
    block = StatBlock(["m"], 128, "cpu")
    assert not block.add(0, torch.empty(0))  # skipped, no call counted
    assert block.rows[0, stats._COL["calls"]] == 0


@needs_native
def test_inside_torch_func_and_under_a_torch_function_mode_the_op_sees_the_call(op_calls):
    block = StatBlock(["grad", "mode"], 32, "cpu")

    def loss(x):
        block.add(0, x)  # a functorch wrapper: only the dispatcher unwraps it
        return x.square().sum()

    torch.func.grad(loss)(torch.arange(6.0))
    with _Passing():  # modes (e.g. a host-transfer counter) see every call they would have seen
        block.add(1, torch.arange(4.0))
    assert len(op_calls) == 2
    rows = block.drain(_OneRank())
    assert rows[:, stats._COL["count"]].tolist() == [6, 4]
    assert rows[:, stats._COL["sum"]].tolist() == [15.0, 6.0]


@needs_native
def test_many_tensors_at_once_give_what_adding_each_gives(op_calls):
    x = _values()
    tensors = [x, x.double(), torch.empty(0), x[:100].view(10, 10).t(), x[7:], torch.ones(3, requires_grad=True)]
    one_by_one = StatBlock(["a", "b", "c"], 128, "cpu")
    added = [one_by_one.add(i % 3, t, i % 2) for i, t in enumerate(tensors)]
    many = StatBlock(["a", "b", "c"], 128, "cpu")
    assert many.add_many([i % 3 for i in range(6)], tensors, [i % 2 for i in range(6)]) == added
    assert added == [True, True, False, True, True, True]
    assert many.rows.tolist() == one_by_one.rows.tolist()
    calls = len(op_calls)
    with _Passing():  # under a mode the op sees every call, as one by one
        many.add_many([0, 1], [x, x], [1, 1])
    assert len(op_calls) == calls + 2


def test_without_the_c_kernel_the_block_uses_the_tensor_op_kernel(monkeypatch):
    monkeypatch.setattr(_binning, "NATIVE_KERNEL", False)
    block = StatBlock(["m"], 16, "cpu")
    assert block._direct is None
    block.add(0, torch.tensor([1.0, 2.0, math.nan]))
    assert block.rows[0, stats._COL["finite"]] == 2


class _Passing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _OneRank:
    world_size = 1


def test_blocks_of_the_same_bins_share_one_binning_and_its_edges():
    a, b = StatBlock(["m"], 16, "cpu"), StatBlock(["x", "y"], 16, "cpu")
    assert a.edges is b.edges == stats.binning(16).edge_list  # computed once, read by both
    assert a._binning(a.rows.device, torch.float64) is stats.binning(16, "cpu", torch.float64)
    assert StatBlock(["m"], [-1.0, 0.0, 1.0], "cpu").edges == (-1.0, 0.0, 1.0)
    assert stats.binning(16).edges.tolist() == stats.histogram_edges(16).tolist()  # the outer edges left as they are
    assert stats.binning(16).left[0] == -math.inf  # the device form's copy takes the open outer bins


def test_riders_come_over_in_the_rows_one_copy_with_their_exact_values_and_the_rows_as_drain_gives_them():
    from tests.helpers import host_transfers

    blocks = [StatBlock(["a", "b"], 16, "cpu") for _ in range(2)]
    for block in blocks:
        block.add(0, _values())
        block.add(1, torch.arange(7.0))
    riders = [torch.tensor(1 / 3, dtype=torch.float32), torch.tensor([0.1, -2.5e-30], dtype=torch.float32)]
    expected = [riders[0].item(), *riders[1].tolist()]  # what a read of each would give
    with host_transfers() as calls:
        rows, values = blocks[0].drain_with(_OneRank(), riders)
    assert calls == {"cpu": 1}
    assert values == expected  # float32 is exact in float64: bit for bit
    alone = blocks[1].drain(_OneRank())
    assert rows.shape == alone.shape and rows.tobytes() == alone.tobytes()
    assert blocks[0].rows.equal(blocks[1].rows)  # both reset
