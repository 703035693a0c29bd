"""The update ratio on many small parameters, every step measured: the step copies' fast path (one
holder, the same parameters each step, the last chained pass's record reused) gives the figures of
the unbatched path, each row measured alone, bit for bit."""

from typing import Callable, Optional

import pytest
import torch
from torch import nn

from lightning_hooks.callbacks._gradient_rows import Row
from lightning_hooks.callbacks._step_copies import StepCopies, step_copies
from lightning_hooks.callbacks._update_ratio import UpdateRatio
from lightning_hooks.measure import _update_passes as passes
from lightning_hooks.measure._chain_plan import ChainPlan
from tests.copy_counts import Counts

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
Change = Callable[[int, list[nn.Parameter]], None]  # (step, params): what happens to them after that step


def _params(count: int = 48) -> list[nn.Parameter]:
    """Many small parameters of every dtype the passes read (sizes 1 to 300: under one C chunk, odd lengths)."""
    gen = torch.Generator().manual_seed(0)
    sizes = [1 + (37 * i) % 300 for i in range(count)]
    return [nn.Parameter(torch.randn(size, generator=gen).to(DTYPES[i % len(DTYPES)])) for i, size in enumerate(sizes)]


def _grads(params: list[nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _run(rows_of: Callable[[list[nn.Parameter]], list[Row]], steps: int, alone: bool,
         change: Optional[Change] = None) -> list[dict[str, float]]:
    """Each step's ratios by row name: one UpdateRatio over every row, every step measured (``alone``), or
    one UpdateRatio per row, each step copied afresh (the unbatched path: no chain, one holder per row)."""
    params = _params()
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    rows = rows_of(params)
    readers = [(UpdateRatio(), rows)] if alone else [(UpdateRatio(), [row]) for row in rows]
    got = []
    for step in range(steps):
        _grads(params, step)
        for reader, chosen in readers:
            reader.take(chosen, optimizer, next_measured=alone)
        optimizer.step()
        figures: dict[str, float] = {}
        for reader, _ in readers:
            block = reader.finish(optimizer, True)[0]
            figures.update(zip(block.rows, block.values))
            reader.discard(keep=alone)
        got.append(figures)
        if change is not None:
            change(step, params)
    for reader, _ in readers:
        reader.forget()
    assert step_copies(optimizer).spare_numel == 0 and not step_copies(optimizer)._chains.kept
    return got


def _one_each(params: list[nn.Parameter]) -> list[Row]:
    return [Row(f"p{i}", [p]) for i, p in enumerate(params)]


def _in_place(step: int, params: list[nn.Parameter]) -> None:
    if step == 1:
        with torch.no_grad():
            params[5].mul_(0.5)  # changed between steps: must be copied afresh, not chained


def _assigned(step: int, params: list[nn.Parameter]) -> None:
    if step == 2:
        params[9].data = params[9].detach() * 0.5  # new memory, no version raised


@pytest.mark.parametrize("native", [True, False], ids=["C passes", "LIGHTNING_HOOKS_NATIVE=0"])
@pytest.mark.parametrize("change", [None, _in_place, _assigned], ids=["unchanged", "in place", "p.data = x"])
def test_many_small_mixed_dtype_parameters_give_the_unbatched_figures_bit_for_bit(monkeypatch, native, change):
    monkeypatch.setattr(passes, "NATIVE_PASSES", native and passes.cupdate is not None)
    expected = _run(_one_each, 5, alone=False, change=change)
    copied = Counts(monkeypatch)
    got = _run(_one_each, 5, alone=True, change=change)
    assert got == expected  # floats compared exactly
    assert all(len(step) == 48 and all(v > 0 for v in step.values()) for step in got)
    every = sum(p.numel() for p in _params())
    if not passes.NATIVE_PASSES:  # no chaining: a copy at every step
        assert copied.copied == [every] * 5 and copied.chained == 0
        return
    changed = {None: [], _in_place: [(2, 5)], _assigned: [(3, 9)]}[change]
    expected_copies = [every, 0, 0, 0, 0]
    for step, index in changed:  # only the changed parameter is copied again, at the step after the change
        expected_copies[step] = _params()[index].numel()
    assert copied.copied == expected_copies and copied.chained == 5


def test_a_weight_tied_into_two_rows_is_not_chained_and_gives_the_unbatched_figures(monkeypatch):
    def tied(params: list[nn.Parameter]) -> list[Row]:
        rows = _one_each(params)
        return [*rows, Row("tied", [params[3], params[7]])]  # params[3] and [7] also have rows of their own

    monkeypatch.setattr(passes, "NATIVE_PASSES", passes.cupdate is not None)
    expected = _run(tied, 4, alone=False)
    copied = Counts(monkeypatch)
    got = _run(tied, 4, alone=True)
    assert got == expected and all(len(step) == 49 for step in got)
    assert copied.chained == 0 and copied.copied == [sum(p.numel() for p in _params())] * 4


@pytest.mark.skipif(passes.cupdate is None, reason="chained by the C passes only")
def test_a_reader_in_another_order_gets_its_squares_in_its_order_after_every_chained_parameter_changed(monkeypatch):
    monkeypatch.setattr(passes, "NATIVE_PASSES", True)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(5 + i, generator=gen) for i in range(4)]
    shared = StepCopies()
    shared.hold("a", params, squares=True)
    before = shared.copies("a")
    shared.release("a", keep=True)
    for p in params:
        p.add_(1.0)  # the step
    shared.update_squares(params, before, alone=True, chain=True)
    assert shared._chains.kept  # the copies hold the parameters as they are now
    for p in params:
        p.mul_(2.0)  # every one changed since: each copied afresh, into the chained copies' memory
    shared.hold("b", params[::-1], squares=True)
    expected = [p.double().square().sum().item() for p in params[::-1]]
    assert shared.squares("b").tolist() == pytest.approx(expected, rel=1e-12)
    assert all(torch.equal(c, p) for c, p in zip(shared.copies("b"), params[::-1]))


@pytest.mark.skipif(not ChainPlan.usable(), reason="the chained C pass is not built here")
def test_a_split_record_keeps_the_shapes_its_pass_saw():
    """A parameter cut to a smaller shape at the same address, after its record was split, is copied afresh."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(5))
    copies = StepCopies()
    copies.hold("r", [a, b], squares=True)
    with torch.no_grad():
        a.add_(1)
        b.add_(1)
    before = copies.copies("r")
    copies.release("r", keep=True)
    copies.update_squares([a, b], before, True, True)
    a.data = a.data[:2]  # the same address, the same version, a new shape
    copies.hold("other", [b], squares=True)
    copies.hold("r", [a], squares=True)
    held = copies.copies("r")[0]
    assert held.shape == a.shape and torch.equal(held, a.detach())


@pytest.mark.skipif(not ChainPlan.usable(), reason="the C passes are not built here")
@pytest.mark.parametrize("change", [None, _in_place, _assigned], ids=["unchanged", "in place", "p.data = x"])
def test_steps_measured_one_after_another_without_a_chain_copy_through_views_made_once(monkeypatch, change):
    """Another reader holding the copies too (no chain) copies them at every step: through the last step's views."""
    monkeypatch.setattr(passes, "NATIVE_PASSES", True)
    expected = _run(_one_each, 5, alone=False, change=change)
    views, buffer = [], passes.numpy_view

    def counted(tensor: torch.Tensor) -> object:
        views[-1] += 1
        return buffer(tensor)

    monkeypatch.setattr(passes, "numpy_view", counted)
    params = _params()
    optimizer, rows, reader = torch.optim.SGD(params, lr=0.1, momentum=0.9), _one_each(params), UpdateRatio()
    got = []
    for step in range(5):
        views.append(0)
        _grads(params, step)
        reader.take(rows, optimizer)  # the next step not chained, but measured: the memory kept
        optimizer.step()
        block = reader.finish(optimizer, True)[0]
        got.append(dict(zip(block.rows, block.values)))
        reader.discard(keep=True)
        if change is not None:
            change(step, params)
    reader.forget()
    assert got == expected  # floats compared exactly
    made = {None: [], _in_place: [], _assigned: [3]}[change]  # new memory: its views made afresh, at the next step
    assert [step for step, n in enumerate(views) if n] == [0, *made]
