"""Counting what the step copies do in a real fit: elements copied per hold, and the chained passes run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_hooks.callbacks import _step_copies
from lightning_hooks.callbacks._step_copies import StepCopies
from lightning_hooks.measure._chain_plan import ChainPlan


class Counts:
    """What the step copies did: elements copied per hold (``copies_of``, or a plan's views), and the chained passes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.copied: list[int] = []
        self.chained = 0
        hold, copies_of, run = StepCopies.hold, _step_copies.copies_of, ChainPlan.run
        planned = ChainPlan.copy_squares

        def counting_hold(shared: StepCopies, *args: Any, **kwargs: Any) -> None:
            self.copied.append(0)  # a hold that copies nothing calls no copies_of
            hold(shared, *args, **kwargs)

        def counting_copies(params: list[torch.Tensor], *args: Any) -> Any:
            self.copied[-1] += sum(p.numel() for p in params)
            return copies_of(params, *args)

        def counting_planned(plan: ChainPlan) -> Any:  # a copy through a plan's views (made once)
            self.copied[-1] += sum(view.size for view in plan.after)  # type: ignore[attr-defined]
            return planned(plan)

        def counting_run(plan: ChainPlan) -> Any:
            self.chained += 1
            return run(plan)

        monkeypatch.setattr(StepCopies, "hold", counting_hold)
        monkeypatch.setattr(_step_copies, "copies_of", counting_copies)
        monkeypatch.setattr(ChainPlan, "run", counting_run)
        monkeypatch.setattr(ChainPlan, "copy_squares", counting_planned)
