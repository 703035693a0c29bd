"""The update ratio's passes (``measure/_update_passes.py``, ``_cupdate.c``): exact float64 sums in
two passes on the CPU (a copy that sums what it moves, a norm of the update that stores none),
the tensor ops elsewhere, and the same figures either way."""

import math
import os

import numpy as np
import pytest
import torch
from torch import nn

from lightning_hooks.callbacks._gradient_rows import Row
from lightning_hooks.callbacks._step_copies import StepCopies
from lightning_hooks.callbacks._update_ratio import UpdateRatio
from lightning_hooks.measure import _update_passes as passes
from lightning_hooks.measure._chain_plan import ChainPlan

needs_native = pytest.mark.skipif(passes.cupdate is None, reason="the C update passes were not built")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
BIG = 2 * (1 << 16) + 37  # more than two of the C passes' chunks: their sums added in order


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (0,), (BIG,), (64, 64), (3,)]
    return [(torch.randn(shape, generator=gen) * 3).to(dtype) for shape in shapes]


def _stepped(params: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(p.float() - 1e-2 * torch.randn(p.shape, generator=gen)).to(p.dtype) for p in params]


def _sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.double().square().sum() for t in tensors])


def _update_sums(after: list[torch.Tensor], before: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(a.double() - b.double()).square().sum() for a, b in zip(after, before)])


def test_update_passes_are_built_where_required():
    # CI sets LIGHTNING_HOOKS_REQUIRE_NATIVE=1: a failed build must not pass as the tensor-op path.
    if os.environ.get("LIGHTNING_HOOKS_REQUIRE_NATIVE") != "1":
        pytest.skip("set LIGHTNING_HOOKS_REQUIRE_NATIVE=1 to require the C passes")
    assert passes.cupdate is not None and passes.NATIVE_PASSES


def _chained(after, copies):
    """The chained pass over ``after`` into ``copies``, as StepCopies runs it; None where the C passes refuse."""
    plan = ChainPlan.of(after, copies)
    return None if plan is None else plan.run()


@needs_native
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_c_passes_copy_bit_for_bit_and_sum_in_float64_for_every_dtype(dtype, threads, monkeypatch):
    monkeypatch.setattr(passes, "NATIVE_PASSES", True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the C passes split over this many
    params = _params(dtype)
    copies = [torch.full_like(p, 7.0) for p in params]
    sums = passes.copy_squares_(copies, params)
    assert all(torch.equal(c.view(torch.uint8), p.view(torch.uint8)) for c, p in zip(copies, params))
    assert sums.dtype == torch.float64 and sums.tolist() == pytest.approx(_sums(params).tolist(), rel=1e-12)
    assert passes.squares(params).tolist() == pytest.approx(_sums(params).tolist(), rel=1e-12)
    after = _stepped(params)
    kept = [c.clone() for c in copies]
    got = passes.update_squares(after, copies, in_place=True)
    assert got.tolist() == pytest.approx(_update_sums(after, params).tolist(), rel=1e-12)
    assert all(torch.equal(c, k) for c, k in zip(copies, kept))  # no update was stored, not even in place


@needs_native
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_chained_pass_gives_the_update_and_the_next_copy_bit_for_bit(dtype, threads, monkeypatch):
    # One pass: the update's sums as update_squares gives them, and the copy holding w_after with
    # the sums copy_squares_ would give at the next step's copy (the same bits, not just close).
    monkeypatch.setattr(passes, "NATIVE_PASSES", True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    params = _params(dtype)
    after, copies = _stepped(params), [p.clone() for p in params]
    deltas, moved = _chained(after, copies)
    assert torch.equal(deltas, passes.update_squares(after, params))
    assert torch.equal(moved, passes.copy_squares_([torch.empty_like(a) for a in after], after))
    assert all(torch.equal(c.view(torch.uint8), a.view(torch.uint8)) for c, a in zip(copies, after))
    assert deltas.tolist() == pytest.approx(_update_sums(after, params).tolist(), rel=1e-12)


@needs_native
@pytest.mark.parametrize("threads", [1, 3])
def test_the_c_pass_reads_plain_cpu_tensors_themselves_in_float64(threads, monkeypatch):
    # The gradient check's read: the tensors' own memory, no numpy view; the sums exact for every narrow
    # dtype, over several chunks and threads, and empty tensors; NaN and Inf stay what they are.
    monkeypatch.setattr(passes, "NATIVE_PASSES", True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    tensors = [t for dtype in (torch.float32, torch.float16, torch.bfloat16) for t in _params(dtype)]
    got = passes.tensor_squares(tensors)
    assert got.dtype == torch.float64 and got.tolist() == pytest.approx(_sums(tensors).tolist(), rel=1e-12)
    sliced = torch.randn(10, 8)[2:5]  # contiguous, at an offset into its storage
    bad = [torch.tensor([1.0, float("nan")]), torch.tensor([-float("inf")]), sliced]
    found = passes.tensor_squares(bad).tolist()
    assert math.isnan(found[0]) and found[1] == math.inf and found[2] == pytest.approx(_sums([sliced]).item())
    huge = torch.full((3,), 3e38)  # finite float32 values whose float32 norm overflows: not here
    assert math.isfinite(passes.tensor_squares([huge]).item())


@needs_native
@pytest.mark.parametrize("refused", ["parameter", "transposed", "float64", "subclass", "a list member not a tensor"])
def test_the_c_pass_on_tensors_takes_all_or_nothing(refused, monkeypatch):
    monkeypatch.setattr(passes, "NATIVE_PASSES", True)

    class Sub(torch.Tensor):
        pass

    odd = {"parameter": nn.Parameter(torch.randn(3)), "transposed": torch.randn(4, 3).t(),
           "float64": torch.randn(3).double(), "subclass": torch.randn(3).as_subclass(Sub),
           "a list member not a tensor": [1.0, 2.0]}[refused]
    assert passes.tensor_squares([torch.randn(5), odd]) is None
    assert passes.tensor_squares([torch.randn(5)]) is not None


def test_the_chained_pass_takes_all_or_nothing():
    # A tensor the C passes cannot read (here not contiguous): None, and no copy written.
    params = [torch.randn(5, 6), torch.randn(6, 5).t()]
    after, copies = _stepped(params), [p.clone() for p in params]
    assert _chained(after, copies) is None
    assert all(torch.equal(c, p) for c, p in zip(copies, params))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_tensor_ops_give_the_same_figures(dtype, monkeypatch):
    monkeypatch.setattr(passes, "NATIVE_PASSES", False)
    params, rel = _params(dtype), 1e-5
    copies = [torch.empty_like(p) for p in params]
    assert passes.copy_squares_(copies, params).tolist() == pytest.approx(_sums(params).tolist(), rel=rel)
    assert all(torch.equal(c, p) for c, p in zip(copies, params))
    after = _stepped(params)
    got = passes.update_squares(after, copies).tolist()
    # Where the tensor ops run the update is rounded to the parameters' dtype before its norm.
    rounded = [(a - b).double().square().sum().item() for a, b in zip(after, params)]
    assert got == pytest.approx(rounded, rel=rel)


def test_a_list_mixing_what_the_c_passes_read_and_what_they_do_not_gives_every_sum_in_order():
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(5, 6, generator=gen).t(), torch.randn(40, generator=gen),  # transposed: not contiguous
              torch.randn(9, generator=gen).to(torch.bfloat16), torch.randn(3, 4, generator=gen)[:, ::2]]
    copies = [torch.empty_like(p) for p in params]
    assert passes.copy_squares_(copies, params).tolist() == pytest.approx(_sums(params).tolist(), rel=1e-6)
    assert all(torch.equal(c, p) for c, p in zip(copies, params))
    after = _stepped(params)
    assert passes.update_squares(after, copies).tolist() == pytest.approx(_update_sums(after, params).tolist(),
                                                                          rel=1e-5)


def test_the_tensor_ops_take_float64_beside_narrower_dtypes_in_order(monkeypatch):
    monkeypatch.setattr(passes, "NATIVE_PASSES", False)
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(5, generator=gen), torch.randn(7, generator=gen).double(),
               torch.randn(3, generator=gen).half(), torch.randn(4, generator=gen).double()]
    assert passes.squares(tensors).tolist() == pytest.approx(_sums(tensors).tolist(), rel=1e-6)


@needs_native
def test_the_c_passes_refuse_buffers_that_do_not_pair():
    out = np.zeros(1)
    with pytest.raises(ValueError, match=r"as many items of one type"):
        passes.cupdate.diff_squares([np.zeros(3, np.float32)], [np.zeros(4, np.float32)], out, 1)
    with pytest.raises(TypeError, match=r"float32 \('f'\), float64"):
        passes.cupdate.squares([np.zeros(3, np.int64)], out, 1)
    with pytest.raises(ValueError, match=r"`out` must hold 2 float64 items"):
        passes.cupdate.squares([np.zeros(3), np.zeros(2)], out, 1)
    with pytest.raises(ValueError, match=r"`out` must hold 2 float64 items"):  # the chained pass: two sums each
        passes.cupdate.chain_squares([np.zeros(3)], [np.zeros(3)], out, 1)
    read_only = np.zeros(3)
    read_only.flags.writeable = False
    with pytest.raises(TypeError, match=r"`before\[0\]` must be a C-contiguous, writable buffer"):
        passes.cupdate.chain_squares([np.zeros(3)], [read_only], np.zeros(2), 1)


def _ratio_step_ops(native: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[set[str], int, list[float]]:
    """The ATen ops of the update ratio's hooks in one step, the bytes they allocated, and the ratios logged."""
    monkeypatch.setattr(passes, "NATIVE_PASSES", native)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows, ratio, ops, allocated = [Row(n, [p]) for n, p in model.named_parameters()], UpdateRatio(), set(), 0
    model(torch.randn(8, 256)).square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        ratio.take(rows, optimizer)
    optimizer.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof2:
        blocks = ratio.finish(optimizer, True)
    ratio.forget()
    for profile in (prof, prof2):
        for event in profile.key_averages():
            ops.add(event.key)
            allocated += max(event.self_cpu_memory_usage, 0)
    expected = [((a.double() - b.double()).norm() / b.double().norm()).item()
                for a, b in zip(model.parameters(), before)]
    assert blocks[0].values == pytest.approx(expected, rel=1e-5)
    return ops, allocated, blocks[0].values


@needs_native
def test_on_the_cpu_the_ratio_is_a_copy_and_one_pass_no_tensor_op_reads_the_parameters(monkeypatch):
    passes_ops = {"aten::_foreach_norm", "aten::_foreach_sub", "aten::_foreach_sub_", "aten::linalg_vector_norm"}
    ops, allocated, fused = _ratio_step_ops(True, monkeypatch)
    copy_bytes = sum(p.numel() * 4 for p in nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]).parameters())
    assert not ops & passes_ops and "aten::_foreach_copy_" not in ops  # the C passes did the reading
    assert copy_bytes <= allocated < copy_bytes + 4096  # the copy itself, and a few sums
    tensor_ops, _, unfused = _ratio_step_ops(False, monkeypatch)  # as before: a norm of the copy, the update, its norm
    assert {"aten::_foreach_norm", "aten::_foreach_sub_", "aten::_foreach_copy_"} <= tensor_ops
    assert fused == pytest.approx(unfused, rel=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["C passes", "tensor ops"])
def test_a_holder_asking_for_squares_of_a_copy_another_made_gets_them_and_they_go_with_the_copy(native, monkeypatch):
    monkeypatch.setattr(passes, "NATIVE_PASSES", native and passes.cupdate is not None)
    params = [torch.randn(33, 7, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    shared = StepCopies()
    shared.hold("transform", params[:2])  # copies two, summing their squares only where free
    shared.hold("ratio", params[::-1], squares=True)  # copies the third; sums the others' from their copies
    assert shared.squares("ratio").tolist() == pytest.approx(_sums(params[::-1]).tolist(), rel=1e-6)
    assert shared.numel == sum(p.numel() for p in params)
    shared.release("transform")
    shared.release("ratio", keep=True)  # the copies' memory kept for the next hold, their sums dropped
    with torch.no_grad():
        params[0].mul_(2.0)
    shared.hold("ratio", params, squares=True)  # into the spares, summed anew
    assert shared.squares("ratio").tolist() == pytest.approx(_sums(params).tolist(), rel=1e-6)
    assert shared.spare_numel == 0
