"""LayerHealth's verdicts: which layer went wrong, and since which step (host-side, pure).

One judge for the package: :class:`Verdicts` (LayerHealth, and through it ``AnomalyReport.diagnosis``)
and the Layers tab's plugin (``tensorboard_plugin/verdicts.py``) feed each logged step's figures
to the same :class:`~lightning_hooks.output._judge.Judge`, so the tab's banner, LayerHealth's
summary and the report name the same layer. How it decides: :mod:`lightning_hooks.output._judge`
and docs/verdicts.md; the thresholds: :class:`Bands` (re-exported here, where the plugin imports it).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from lightning_hooks.output._findings import EVERY_LAYER as EVERY_LAYER
from lightning_hooks.output._findings import SCALE_RATIO, Judged, owner_of
from lightning_hooks.output._health_bands import PROBLEMS as PROBLEMS
from lightning_hooks.output._health_bands import Bands as Bands
from lightning_hooks.output._judge import Judge

#: A text entry (JSON: ``{"unjudged": [names], "scales": [names]}``) GradientMonitor(update_ratio=True) writes once
#: per fit: the update rows whose ratio is not judged, and the norms' scales judged apart, so that the Layers tab
#: judges the rows as LayerHealth does.
UNJUDGED_RATIOS_TAG = "layers/unjudged_ratios"


def judged_figure(figure: str, row: str, value: float, unjudged: Collection[str],
                  scales: Collection[str]) -> Optional[str]:
    """The figure a row's value is judged as, or None where it is not judged; LayerHealth's and the tab's rule.

    A norm's scale's (``scales``, ``callbacks/_judged_rows.py``) finite update ratio is :data:`SCALE_RATIO`: a param
    group's learning rate raised on a norm shows there alone (its outputs move a few %), judged by a step far
    above its own range only. The other 1-D rows' (``unjudged``) and a scale's finite
    ratio and gradient norm are left out. A NaN is a NaN.
    """
    if figure not in ("ratio", "norm") or not math.isfinite(value) or (row not in unjudged and row not in scales):
        return figure
    return SCALE_RATIO if figure == "ratio" and row in scales else None


#: The logged stats that say whether a layer's outputs held a non-finite value.
NONFINITE_STATS = ("nonfinite_fraction", "nan_count", "posinf_count", "neginf_count")
#: The bands of TransformerStability's figures (fields of :class:`Bands`).
STABILITY_BANDS = ("max_attention_logit", "min_entropy_fraction", "max_output_logit", "max_massive_ratio")
#: TransformerStability's judged stats: each is the name of its judged figure too.
STABILITY_STATS = ("attention_max_logit", "attention_entropy", "logit_abs_max", "massive_ratio")
#: Which judged figure each logged ``(kind, stat)`` feeds: LayerHealth and the Layers tab judge these, and only these.
JUDGED = {("activations", "zero_fraction"): "zero_fraction", ("gradients", "norm"): "norm",
          ("activations", "std"): "level", ("activation_grads", "std"): "output_grad",
          ("updates", "ratio"): "ratio", ("activation_grads", "pull"): "pull",
          **{("activations", stat): "nonfinite" for stat in NONFINITE_STATS},
          **{("activations", stat): stat for stat in STABILITY_STATS}}

#: The problems each figure can show.
FIGURE_PROBLEMS = {
    "zero_fraction": ("dead",), "nonfinite": ("nonfinite",), "ratio": ("too_fast", "too_slow"),
    "level": ("blowup", "collapse", "data"), "norm": ("nonfinite_grad", "exploding", "vanishing"),
    "output_grad": ("output_grad_exploding", "output_grad_vanishing"), "pull": (),
    "attention_max_logit": ("attention_logits",), "attention_entropy": ("entropy_collapse",),
    "logit_abs_max": ("output_logits",), "massive_ratio": ("massive",),
}

#: The figures of the backward pass: a fault's gradients go out in every layer before it at its step.
BACKWARD_FIGURES = ("norm", "output_grad")

Figures = Mapping[str, Mapping[str, float]]
"""One logged step's judged figures: per figure (a value of :data:`JUDGED`), each row's value."""


@dataclass
class Episode:
    """One layer outside one band: from ``first`` to ``last`` logged step, and its worst value there."""

    first: int
    last: int
    worst: float
    ongoing: bool = True


class Verdicts:
    """Feed each logged step's figures to one :class:`~lightning_hooks.output._judge.Judge`; keep the named episodes.

    The figures of a step may come in several calls (activations at the batch's end, gradients
    before the optimizer step): they are judged together once the next step's first figure
    comes, or the record is read.
    """

    def __init__(self, bands: Bands) -> None:
        self.bands = bands
        self.judge = Judge(bands)
        self._episodes: dict[tuple[str, str], Episode] = {}
        self.first: dict[tuple[str, str], tuple[int, float]] = {}  # by (figure, row): its first logged value
        self.victims: dict[str, int] = {}  # rows out because of a named layer, and since which step
        self._pending: dict[str, dict[str, float]] = {}
        self._pending_step: Optional[int] = None
        self.last_step: Optional[int] = None

    def add(self, figure: str, step: int, values: Mapping[str, float]) -> None:
        """Take one logged step's ``values`` (by row) of ``figure`` (a value of :data:`JUDGED`)."""
        if self._pending_step is not None and step != self._pending_step:
            self.flush()
        self._pending_step = step
        self._pending.setdefault(figure, {}).update(values)
        self.last_step = step if self.last_step is None else max(step, self.last_step)
        for row, value in values.items():  # a scale's ratio is a ratio to the record
            self.first.setdefault(("ratio" if figure == SCALE_RATIO else figure, row), (step, value))

    def flush(self) -> Optional[Judged]:
        """Judge the step taken so far (if any); return the judgement."""
        if self._pending_step is None:
            return None
        step, figures = self._pending_step, self._pending
        self._pending, self._pending_step = {}, None
        judged = self.judge.step(figures, step)
        named = {(f.problem, f.row): f for f in judged.named}
        for key, episode in self._episodes.items():
            if episode.ongoing and key not in named and (key[0] == "data" or _figure_of(key[0]) in figures):
                episode.ongoing = False
        for (problem, row), finding in named.items():
            self._note(problem, row, step, finding.value)
        self.victims = {f.row: self.victims.get(f.row, step) for f in judged.victims
                        if f.row in self.judge.affected} | {r: s for r, s in self.victims.items()
                                                             if r in self.judge.affected}
        return judged

    @property
    def episodes(self) -> dict[tuple[str, str], Episode]:
        """Each named ``(problem, row)``'s latest episode (the step taken so far judged first)."""
        self.flush()
        return self._episodes

    def state_dict(self) -> dict[str, Any]:
        """The record so far, as plain values (for a callback's checkpoint)."""
        self.flush()
        return {"episodes": [[p, layer, vars(e).copy()] for (p, layer), e in self._episodes.items()],
                "judge": self.judge.state_dict(), "victims": dict(self.victims),
                "first": [[f, layer, step, v] for (f, layer), (step, v) in self.first.items()],
                "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the record of :meth:`state_dict`."""
        self._episodes = {(p, layer): Episode(**e) for p, layer, e in state["episodes"]}
        self.judge.load_state_dict(state["judge"])
        self.victims = dict(state["victims"])
        self.first = {(f, layer): (step, v) for f, layer, step, v in state["first"]}
        self.last_step, self._pending, self._pending_step = state["last_step"], {}, None

    def _note(self, problem: str, row: str, step: int, value: float) -> None:
        episode = self._episodes.get((problem, row))
        if episode is None or not episode.ongoing:
            self._episodes[(problem, row)] = Episode(step, step, value)
            return
        episode.last = step
        if _worse(problem, value, episode.worst):
            episode.worst = value

    def summary(self, top_k: int) -> str:
        """The verdict: ``healthy``, or each problem with its layers, the planted-first (earliest) first."""
        head = f"Layer health at step {self.last_step}"
        if not self.episodes:
            return f"{head}: healthy (no layer out of its usual range; see docs/verdicts.md)."
        titles = self.bands.titles()
        now = sorted(((p, layer, e) for (p, layer), e in self.episodes.items() if e.ongoing), key=self.order)
        before = sorted(((p, layer, e) for (p, layer), e in self.episodes.items() if not e.ongoing), key=self.order)
        # A parameter's row is its module's: a module with its output and its weight's gradient out is one layer.
        layers = {self.judge.layer(_figure_of(p), row) for p, row, _ in now}
        count = f"{len(layers)} layer{'s' if len(layers) > 1 else ''}"
        lines = [f"{head}: {count} unhealthy now" if now else f"{head}: healthy now"]
        if now and self.victims:
            lines[0] += (f" ({len(self.victims)} other row{'s' if len(self.victims) > 1 else ''} out since step"
                         f" {min(self.victims.values())}, taken as what {'they' if len(layers) > 1 else 'it'} did)")
        for problem in dict.fromkeys(p for p, _, _ in now):  # the problem named first, first
            rows = [(layer, e) for p, layer, e in now if p == problem]
            if rows:
                lines.append(f"  {titles[problem]}")
                lines.extend(f"    {layer:24} worst {e.worst:<10.4g} since step {e.first}" for layer, e in rows[:top_k])
                if len(rows) > top_k:
                    lines.append(f"    ... and {len(rows) - top_k} more")
        if before:
            lines.append("  earlier, healthy since:")
            lines.extend(f"    {layer:24} {titles[p].partition(':')[0]}, steps {e.first}-{e.last} (worst {e.worst:.4g})"
                         for p, layer, e in before[:top_k])
            if len(before) > top_k:
                lines.append(f"    ... and {len(before) - top_k} more")
        return "\n".join(lines)

    def order(self, item: tuple[str, str, Episode]) -> tuple[int, bool, int, int]:
        """The sort key of an episode ``(problem, row, episode)`` in the summary and the diagnosis.

        The earliest episode first (the layer named first is the culprit); at one step the forward
        pass's figures (outputs, update ratios, the bounds) before the backward pass's (gradients,
        which a fault sends to every layer *before* it); then the layer's place in forward order (a
        parameter's row at its module's: a cause upstream comes before what it did downstream), then
        the problem kind (as :data:`PROBLEMS` lists them).
        """
        problem, row, episode = item
        depth = self.judge.depth.get(row, self.judge.depth.get(owner_of(row), 0))
        return episode.first, _figure_of(problem) in BACKWARD_FIGURES, depth, list(PROBLEMS).index(problem)


def _figure_of(problem: str) -> str:
    """The figure a problem is judged from."""
    return next(figure for figure, problems in FIGURE_PROBLEMS.items() if problem in problems)


def _worse(problem: str, value: float, than: float) -> bool:
    """Whether ``value`` is further outside the band of ``problem`` than ``than``."""
    if problem in ("vanishing", "too_slow", "entropy_collapse", "collapse", "output_grad_vanishing"):
        return value < than
    if problem.startswith("nonfinite"):
        return False
    return value > than
