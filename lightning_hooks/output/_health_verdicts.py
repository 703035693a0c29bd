"""LayerHealth's verdicts: which layers are outside a healthy band, and since which step (host-side, pure).

One set of rules for the package: :class:`Verdicts` (LayerHealth) and the Layers tab's plugin
(``tensorboard_plugin/verdicts.py``) judge each logged step with the same functions
(``judge_zero_fraction``, ``judge_nonfinite``, ``judge_ratio``, ``judge_norm``) against the same
:class:`Bands`, so the tab's banner and LayerHealth's summary name the same layers.

The bands and where each default comes from: :mod:`lightning_hooks.output._health_bands`, which
holds :class:`Bands` (re-exported here, where the TensorBoard plugin imports it).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_hooks.output._health_bands import PROBLEMS as PROBLEMS
from lightning_hooks.output._health_bands import Bands as Bands

#: A text entry (JSON: a list of names) GradientMonitor(update_ratio=True) writes once per fit: the
#: update rows whose ratio is not judged, so that the Layers tab leaves out the rows LayerHealth does.
UNJUDGED_RATIOS_TAG = "layers/unjudged_ratios"


def unjudged_ratios(pl_module: Any) -> set[str]:
    """The rows whose update ratio is not judged: ``pl_module``'s 1-D parameters (biases, norms' scales).

    Their few small entries give large, noisy ratios on healthy runs; a module row holds its
    weights too, and is judged.
    """
    return {name for name, param in pl_module.named_parameters() if param.ndim < 2}


#: The logged stats that say whether a layer's outputs held a non-finite value.
NONFINITE_STATS = ("nonfinite_fraction", "nan_count", "posinf_count", "neginf_count")
#: The bands of TransformerStability's figures (fields of :class:`Bands`).
STABILITY_BANDS = ("max_attention_logit", "min_entropy_fraction", "max_output_logit", "max_massive_ratio")
#: TransformerStability's judged stats: each is the name of its judged figure too.
STABILITY_STATS = ("attention_max_logit", "attention_entropy", "logit_abs_max", "massive_ratio")
#: Which judged figure each logged ``(kind, stat)`` feeds: LayerHealth and the Layers tab judge these, and only these.
JUDGED = {("activations", "zero_fraction"): "zero_fraction", ("gradients", "norm"): "norm",
          ("updates", "ratio"): "ratio", **{("activations", stat): "nonfinite" for stat in NONFINITE_STATS},
          **{("activations", stat): stat for stat in STABILITY_STATS}}

#: The problems each figure can show.
FIGURE_PROBLEMS = {
    "zero_fraction": ("dead",), "nonfinite": ("nonfinite",), "ratio": ("too_fast", "too_slow"),
    "norm": ("nonfinite_grad", "exploding", "vanishing"),
    "attention_max_logit": ("attention_logits",), "attention_entropy": ("entropy_collapse",),
    "logit_abs_max": ("output_logits",), "massive_ratio": ("massive",),
}

StepValues = Mapping[str, float]
"""One logged step of one figure: each layer's value."""
Judge = Callable[[StepValues, Bands], dict[str, str]]
"""The problem of each layer outside its band at one logged step."""
History = Mapping[str, Sequence[float]]
"""Each layer's last logged finite gradient norms (at most ``Bands.window``), oldest first."""


def judge_zero_fraction(values: StepValues, bands: Bands) -> dict[str, str]:
    """Dead units: the layers whose share of exact zeros is above ``max_zero_fraction``."""
    return {layer: "dead" for layer, v in values.items() if v > bands.max_zero_fraction}


def judge_nonfinite(values: StepValues, bands: Bands) -> dict[str, str]:
    """The layers with a non-finite share or count that is not 0 (NaN included)."""
    return {layer: "nonfinite" for layer, v in values.items() if v != 0}


def judge_ratio(values: StepValues, bands: Bands) -> dict[str, str]:
    """Update ratios outside ``update_ratio_band``; an undefined one (0, inf or NaN) is not judged."""
    low, high = bands.update_ratio_band
    return {layer: "too_fast" if v > high else "too_slow" for layer, v in values.items()
            if math.isfinite(v) and v > 0 and not low <= v <= high}


def judge_norm(values: StepValues, bands: Bands, history: History) -> dict[str, str]:
    """Gradient norms: non-finite, exploding or vanishing.

    Exploding: above ``spike_factor`` times the median of the layer's own ``history`` (once it
    has 3 points); vanishing: below the step's largest finite norm divided by ``spread_factor``.
    """
    largest = max((v for v in values.values() if math.isfinite(v)), default=0.0)
    judged = {}
    for layer, value in values.items():
        past = history.get(layer, ())
        if not math.isfinite(value):
            judged[layer] = "nonfinite_grad"
        elif len(past) >= 3 and value > bands.spike_factor * statistics.median(past):
            judged[layer] = "exploding"
        elif value < largest / bands.spread_factor:
            judged[layer] = "vanishing"
    return judged


def judge_above(problem: str, band: str) -> Judge:
    """A judge of the layers whose figure is above the band named ``band`` (a field of :class:`Bands`)."""
    def judged(values: StepValues, bands: Bands) -> dict[str, str]:
        limit = getattr(bands, band)
        return {layer: problem for layer, v in values.items() if v > limit}
    return judged


def judge_entropy(values: StepValues, bands: Bands, history: History) -> dict[str, str]:
    """Entropy collapse: below ``min_entropy_fraction`` of the layer's first logged value (``history[layer][0]``)."""
    return {layer: "entropy_collapse" for layer, v in values.items()
            if history.get(layer) and v < bands.min_entropy_fraction * history[layer][0]}


def judge(figure: str, values: StepValues, bands: Bands, norms: dict[str, deque[float]]) -> dict[str, str]:
    """One logged step of ``figure`` (a value of :data:`JUDGED`): the problem of each layer outside its band.

    For ``"norm"``, each finite norm is then added to its layer's history in ``norms`` (the
    caller keeps it from step to step, the steps in order).
    """
    if figure == "attention_entropy":
        judged = judge_entropy(values, bands, norms)
        for layer, value in values.items():  # the first finite value is the baseline
            if math.isfinite(value) and value > 0 and layer not in norms:
                norms[layer] = deque([value], maxlen=1)
        return judged
    if figure != "norm":
        return _JUDGES[figure](values, bands)
    judged = judge_norm(values, bands, norms)
    for layer, value in values.items():
        if math.isfinite(value):
            norms.setdefault(layer, deque(maxlen=bands.window)).append(value)
    return judged


_JUDGES: dict[str, Judge] = {
    "zero_fraction": judge_zero_fraction, "nonfinite": judge_nonfinite, "ratio": judge_ratio,
    "attention_max_logit": judge_above("attention_logits", "max_attention_logit"),
    "logit_abs_max": judge_above("output_logits", "max_output_logit"),
    "massive_ratio": judge_above("massive", "max_massive_ratio"),
}


@dataclass
class Episode:
    """One layer outside one band: from ``first`` to ``last`` logged step, and its worst value there."""

    first: int
    last: int
    worst: float
    ongoing: bool = True


class Verdicts:
    """Judge each logged figure of each layer against :class:`Bands`, and keep each layer's latest episode."""

    def __init__(self, bands: Bands) -> None:
        self.bands = bands
        self.episodes: dict[tuple[str, str], Episode] = {}
        self._history: dict[str, dict[str, deque[float]]] = {}  # by figure: gradient norms, entropy baselines
        self.first: dict[tuple[str, str], tuple[int, float]] = {}  # by (figure, layer): its first logged value
        self._depth: dict[str, int] = {}  # layers in the order their figures first came
        self.last_step: Optional[int] = None

    def add(self, figure: str, step: int, values: Mapping[str, float]) -> None:
        """Judge one logged step's ``values`` (by layer) of ``figure``.

        ``figure`` is ``"zero_fraction"``, ``"nonfinite"`` (any non-finite share or count),
        ``"norm"`` (gradient norms) or ``"ratio"`` (update ratios).
        """
        self.last_step = step if self.last_step is None else max(step, self.last_step)
        for layer in values:
            self._depth.setdefault(layer, len(self._depth))
        judged = judge(figure, values, self.bands, self._history.setdefault(figure, {}))
        for layer, value in values.items():
            self.first.setdefault((figure, layer), (step, value))
            for problem in FIGURE_PROBLEMS[figure]:
                self._note(problem, layer, step, value, judged.get(layer) == problem)

    def state_dict(self) -> dict[str, Any]:
        """The record so far, as plain values (for a callback's checkpoint)."""
        return {"episodes": [[p, layer, vars(e).copy()] for (p, layer), e in self.episodes.items()],
                "history": {f: {layer: list(d) for layer, d in h.items()} for f, h in self._history.items()},
                "first": [[f, layer, step, v] for (f, layer), (step, v) in self.first.items()],
                "depth": dict(self._depth), "last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the record of :meth:`state_dict`."""
        self.episodes = {(p, layer): Episode(**e) for p, layer, e in state["episodes"]}
        self._history = {f: {layer: deque(v, maxlen=1 if f == "attention_entropy" else self.bands.window)
                             for layer, v in h.items()} for f, h in state["history"].items()}
        self.first = {(f, layer): (step, v) for f, layer, step, v in state["first"]}
        self._depth, self.last_step = dict(state["depth"]), state["last_step"]

    def _note(self, problem: str, layer: str, step: int, value: float, flagged: bool) -> None:
        episode = self.episodes.get((problem, layer))
        if not flagged:
            if episode is not None:
                episode.ongoing = False
            return
        if episode is None or not episode.ongoing:
            self.episodes[(problem, layer)] = Episode(step, step, value)
            return
        episode.last = step
        if _worse(problem, value, episode.worst):
            episode.worst = value

    def summary(self, top_k: int) -> str:
        """The verdict: ``healthy``, or each problem with its layers, the planted-first (earliest) first."""
        head = f"Layer health at step {self.last_step}"
        if not self.episodes:
            return f"{head}: healthy (every layer inside the bands; see LayerHealth's docstring)."
        titles = self.bands.titles()
        now = sorted(((p, layer, e) for (p, layer), e in self.episodes.items() if e.ongoing), key=self.order)
        before = sorted(((p, layer, e) for (p, layer), e in self.episodes.items() if not e.ongoing), key=self.order)
        layers = {layer for _, layer, _ in now}
        count = f"{len(layers)} layer{'s' if len(layers) > 1 else ''}"
        lines = [f"{head}: {count} unhealthy now" if now else f"{head}: healthy now"]
        for problem in PROBLEMS:
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

    def order(self, item: tuple[str, str, Episode]) -> tuple[int, int, int]:
        """The sort key of an episode ``(problem, layer, episode)`` in the summary and the diagnosis.

        Problem kind first (as :data:`PROBLEMS` lists them), then the earliest episode (where it
        began), then the layer's depth (the order its figures first came).
        """
        problem, layer, episode = item
        return list(PROBLEMS).index(problem), episode.first, self._depth.get(layer, 0)


def _worse(problem: str, value: float, than: float) -> bool:
    """Whether ``value`` is further outside the band of ``problem`` than ``than``."""
    if problem in ("vanishing", "too_slow", "entropy_collapse"):
        return value < than
    if problem.startswith("nonfinite"):
        return False
    return value > than
