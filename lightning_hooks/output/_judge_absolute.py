"""The judge's absolute rules: bounds the physics gives, no history needed (host-side, torch-free).

The half of :mod:`lightning_hooks.output._judge` that needs no row's range: a NaN or Inf in a
module's outputs, nearly all its outputs exact zeros (or more than ``max_zero_fraction`` from its first
logged point on, or for a few logged points in a row as its live outputs fell by half: dead units), and
TransformerStability's attention-logit, entropy, output-logit and massive-activation bounds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from lightning_hooks.output._health_bands import Bands

#: TransformerStability's figures with an upper bound: each one's field of :class:`Bands` and its problem.
UPPER_BOUNDS = {"attention_max_logit": ("max_attention_logit", "attention_logits"),
                "logit_abs_max": ("max_output_logit", "output_logits"),
                "massive_ratio": ("max_massive_ratio", "massive")}


#: A module's outputs this many exact zeros (or ``max_zero_fraction``, if higher) are dead at once: nearly every
#: unit silent for every sample. Between ``max_zero_fraction`` and this, most outputs zero is dead units where it
#: was so from the module's first logged point (units dead at the initialisation), or stays so for ``SPARSE_POINTS``
#: logged points in a row: a healthy ReLU's sparsity over a small batch (512 values at batch 2) crosses 0.8 for one
#: batch (the sweep's 256-wide MLP, ``unseen10``: 0.65-0.81).
ALL_ZERO = 0.99
SPARSE_POINTS = 3
#: ... and where its live outputs (those not zero) fell to at most ``DYING_SHARE`` of the most they were over its
#: last ``DYING_STEPS`` steps: units dying, not a ReLU's sparsity creeping up as it learns (a healthy 1024-wide
#: MLP's: 0.5 to 0.8 zeros over 250 steps, crossing 0.8 for a few batches in a row; a plain CNN's last ReLU at twice
#: its LR: 0.5 to 0.81 over 100 steps, its live share halved within 48). In steps, not logged points: logged every
#: 5, 24 points would be 120 steps of learning. Logged more coarsely, over at least its last ``SPARSE_POINTS + 1``
#: points (the run above the bound and the point before it). Named so, it stays named while above the bound.
DYING_SHARE = 0.5
DYING_STEPS = 24


@dataclass
class ZeroRuns:
    """Per module: the logged points in a row with most outputs zero, whether it ever had fewer, its live shares.

    The live share is the share of its outputs not zero, kept with its step for the last ``DYING_STEPS`` steps (at
    least the last ``SPARSE_POINTS + 1`` points).
    ``died``: the modules named dead by that run as their units died, named while they stay above the bound (the
    fall leaves the kept points; the units stay dead).
    """

    runs: dict[str, int] = field(default_factory=dict)
    fired: set[str] = field(default_factory=set)
    live: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)
    died: set[str] = field(default_factory=set)

    def add(self, values: Mapping[str, float], step: int) -> None:
        """Keep a step's live shares, ``1 - zero fraction``, finite ones only, and drop those no longer judged by."""
        for row, v in values.items():
            if math.isfinite(v):
                kept = self.live.setdefault(row, deque())
                kept.append((step, 1.0 - v))
                while len(kept) > SPARSE_POINTS + 1 and step - kept[0][0] > DYING_STEPS:
                    kept.popleft()

    def dying(self, row: str) -> bool:
        """Whether ``row``'s newest live share is at most ``DYING_SHARE`` of the most it had over its kept steps."""
        live = self.live.get(row)
        return bool(live) and live[-1][1] <= DYING_SHARE * max(share for _, share in live)

    def state_dict(self) -> dict[str, Any]:
        """As plain values."""
        return {"runs": dict(self.runs), "fired": sorted(self.fired),
                "live": {row: [list(point) for point in v] for row, v in self.live.items()}, "died": sorted(self.died)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ZeroRuns:
        """The runs of :meth:`state_dict`'s values."""
        live = {row: deque((int(step), share) for step, share in v) for row, v in state.get("live", {}).items()}
        return cls(dict(state["runs"]), set(state["fired"]), live, set(state.get("died", ())))


def absolute_problems(figure: str, values: Mapping[str, float], bands: Bands,
                      first_entropy: MutableMapping[str, float], zeros: ZeroRuns, step: int,
                      from_start: bool = False) -> list[tuple[str, str, float]]:
    """The rows of an absolute ``figure`` past their bound, as ``(row, problem, value)``.

    Args:
        figure: ``nonfinite``, ``zero_fraction`` or a TransformerStability figure.
        values: Each row's value at the step.
        bands: The bounds.
        first_entropy: Each row's first finite positive attention entropy (updated here): entropy
            collapse is judged against it.
        zeros: Each row's points in a row with more than ``max_zero_fraction`` zeros (updated here from a
            ``zero_fraction`` step's values; a row absent at a step keeps its count: a module not called).
        step: The step (or, where the judge is given none, its count of logged points): units dying are judged
            over the last ``DYING_STEPS``.
        from_start: Whether the judge saw the run from its start: only then is a row above the bound at
            every point so far dead from the initialisation (a resumed fit's first point is not its first).
    """
    if figure == "nonfinite":
        return [(row, "nonfinite", v) for row, v in values.items() if v != 0]
    if figure == "zero_fraction":
        zeros.fired.update(row for row, v in values.items() if not v > bands.max_zero_fraction)
        over = {row: zeros.runs.get(row, 0) + 1 for row, v in values.items() if v > bands.max_zero_fraction}
        zeros.runs = {**{row: run for row, run in zeros.runs.items() if row not in values}, **over}
        zeros.add(values, step)
        zeros.died = {row for row in zeros.died if row not in values or row in over}  # back under the bound: alive
        zeros.died.update(row for row, run in over.items() if run >= SPARSE_POINTS and zeros.dying(row))
        at_once = max(ALL_ZERO, bands.max_zero_fraction)
        return [(row, "dead", values[row]) for row in over
                if values[row] >= at_once or row in zeros.died or (from_start and row not in zeros.fired)]
    if figure == "attention_entropy":
        for row, v in values.items():
            if math.isfinite(v) and v > 0:
                first_entropy.setdefault(row, v)
        return [(row, "entropy_collapse", v) for row, v in values.items()
                if row in first_entropy and v < bands.min_entropy_fraction * first_entropy[row]]
    field, problem = UPPER_BOUNDS[figure]
    limit = getattr(bands, field)
    return [(row, problem, v) for row, v in values.items() if v > limit]
