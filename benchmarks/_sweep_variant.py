"""A fault-sweep variant: one recipe varied from the zoo's, and how it is added to the zoo's recipes.

Used by ``benchmarks/fault_sweep.py`` and its groups (``benchmarks/_sweep_unseen3.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from benchmarks._zoo_models import RECIPES
from benchmarks.fault_zoo import GROWTH, JUMP


@dataclass(frozen=True)
class Variant:
    """One recipe varied from the zoo's, with the faults it is run with (``healthy``: none)."""

    group: str
    model: str
    faults: tuple[str, ...]
    target: str = ""  # the module every fault goes in, if not the recipe's own
    steps: int = 200
    onset: float = 0.5  # as a fraction of the run
    every: int = 2
    growth: float = GROWTH
    hold: int = 0  # a ramp grows for this many steps from the onset, then holds; 0: it grows to the end
    jump: float = JUMP
    optimizer: str = ""  # "sgd", "adamw" (warm-up and cosine), "adamw-flat" (constant LR) ... (``schedule``)
    lr: float = 0.0
    precision: str = ""
    clip: float = 0.0  # the gradients' norm clipped to this; 0: the recipe's own (not clipped)
    accumulate: int = 1  # micro-batches a step
    batch: int = 0  # the batch size; 0: the recipe's own
    weight_decay: float = -1.0  # SGD's weight decay; below 0: the recipe's own (5e-4)
    seed: Optional[int] = None  # the variant's own seed; None: the sweep's ``--seed``
    frozen: str = ""  # a module that does not train; "": none
    thaw: float = 0.0  # when ``frozen`` starts to train, as a fraction of the run; 0: never

    @property
    def name(self) -> str:
        """The variant's recipe name: the model and what differs from it."""
        parts = [self.model, self.target and f"@{self.target}", self.optimizer, self.lr and f"lr{self.lr:g}",
                 self.precision,
                 self.clip and f"clip{self.clip:g}", self.accumulate > 1 and f"acc{self.accumulate}",
                 self.batch and f"b{self.batch}", self.weight_decay >= 0 and f"wd{self.weight_decay:g}",
                 self.seed is not None and f"s{self.seed}", self.frozen and f"frozen={self.frozen}",
                 self.thaw and f"thaw{self.thaw:g}"]
        return "+".join(p for p in parts if p)

    def recipe_key(self) -> tuple[Any, ...]:
        """What a healthy twin shares: recipe, run length, log interval and seed."""
        return (self.model, self.optimizer, self.lr, self.precision, self.clip, self.accumulate, self.steps,
                self.every, self.seed, self.batch, self.weight_decay, self.frozen, self.thaw)


def _fault_targets(v: Variant) -> dict[str, str]:
    targets = dict(RECIPES[v.model].targets)
    return {**targets, **dict.fromkeys(("ramp", "jump", "dead", "nan", "vanish"), v.target)} if v.target else targets


def register(v: Variant) -> str:
    """Add the variant's recipe to the zoo's recipes, under its name."""
    base = RECIPES[v.model]
    RECIPES[v.name] = replace(base, name=v.name, targets=_fault_targets(v), optimizer=v.optimizer or base.optimizer,
                              lr=v.lr or base.lr, precision=v.precision or base.precision, clip=v.clip or base.clip,
                              accumulate=v.accumulate, batch=v.batch or base.batch,
                              weight_decay=base.weight_decay if v.weight_decay < 0 else v.weight_decay,
                              frozen=v.frozen or base.frozen, thaw=v.thaw or base.thaw)
    return v.name
