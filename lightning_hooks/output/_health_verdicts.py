"""LayerHealth's verdicts: which layers are outside a healthy band, and since which step (host-side, pure).

One set of rules for the package: :class:`Verdicts` (LayerHealth) and the Layers tab's plugin
(``tensorboard_plugin/verdicts.py``) judge each logged step with the same functions
(``judge_zero_fraction``, ``judge_nonfinite``, ``judge_ratio``, ``judge_norm``) against the same
:class:`Bands`, so the tab's banner and LayerHealth's summary name the same layers.

The bands, and where each comes from:

- dead units: a ReLU-like layer whose inputs are centred outputs about half zeros; above
  ``max_zero_fraction`` (0.8) of its outputs exactly 0, most of its units never fire.
- exploding gradients: a row's gradient norm above ``spike_factor`` (10) times the median of
  its own last ``window`` logged norms (at least 3): a jump against the layer's own history,
  not a large norm, which a wide layer has by its size.
- vanishing gradients: a row's norm below the largest row norm at that step divided by
  ``spread_factor`` (1e5): five decades below its neighbours, far beyond the spread of a
  healthy network's weights and biases.
- update ratio: ``||Δw|| / ||w||`` outside ``update_ratio_band`` (1e-4 to 1e-2, two decades
  around the usual 1e-3): the layer learns too fast or too slowly. An undefined ratio (a
  parameter that was all zeros) is not judged.
- non-finite: any NaN or Inf in a layer's outputs, or in its gradient norm.
- attention logit growth (TransformerStability): the largest ``q·k·scale`` above
  ``max_attention_logit`` (30): at a logit gap of 30 the top key takes all but ``e^-30`` of its
  weight, so the softmax has saturated and its gradient vanishes; at initialisation these logits
  are O(1), and Dehghani et al. 2023 (ViT-22B) and Wortsman et al. 2023 saw them grow without
  bound before divergence.
- attention entropy collapse: a layer's mean attention entropy below ``min_entropy_fraction``
  (0.1) of its first logged value: its heads went from spreading their attention to looking
  at one token each (Zhai et al. 2023, who tie it to training instability).
- output logit growth: the largest ``|logit|`` above ``max_output_logit`` (100): in bfloat16 a
  logit past 128 is rounded to a whole nat, and z-loss (PaLM) exists to keep ``log Z`` near 0.
- massive activations: a block's ``max|x| / median|x|`` above ``max_massive_ratio`` (1e4):
  Sun et al. 2024 report a few features ~1e4 times the median in large language models,
  where they act as attention sinks; far from harmless in low precision.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_hooks.core._validation import check_int, check_number

#: The problems, in the order the summary lists them, with how each is written.
PROBLEMS = {
    "nonfinite": "non-finite outputs",
    "nonfinite_grad": "non-finite gradients",
    "dead": "dead units: zero fraction of outputs above {max_zero_fraction:g}",
    "exploding": "exploding gradients: norm above {spike_factor:g}x its own median",
    "vanishing": "vanishing gradients: norm below the largest layer's / {spread_factor:g}",
    "too_fast": "learning too fast: update ratio above {high:g}",
    "too_slow": "learning too slowly: update ratio below {low:g}",
    "attention_logits": "attention logit growth: max attention logit above {max_attention_logit:g}",
    "entropy_collapse": "attention entropy collapse: entropy below {min_entropy_fraction:g}x its first logged value",
    "output_logits": "output logit growth: max |logit| above {max_output_logit:g}",
    "massive": "massive activations: max|x| / median|x| above {max_massive_ratio:g}",
}


@dataclass(frozen=True)
class Bands:
    """The healthy bands LayerHealth judges by (see the module docstring for where each comes from).

    Raises:
        ValueError: If ``max_zero_fraction`` is not in (0, 1], a factor is not a number above 1,
            ``window`` is not an int of at least 3, or ``update_ratio_band`` is not ``(low, high)``
            with ``0 < low < high``.
    """

    max_zero_fraction: float = 0.8
    spike_factor: float = 10.0
    spread_factor: float = 1e5
    update_ratio_band: tuple[float, float] = (1e-4, 1e-2)
    window: int = 20
    max_attention_logit: float = 30.0
    min_entropy_fraction: float = 0.1
    max_output_logit: float = 100.0
    max_massive_ratio: float = 1e4

    def __post_init__(self) -> None:
        check_number("max_zero_fraction", self.max_zero_fraction, 0.0, high=1.0)
        check_number("spike_factor", self.spike_factor, 1.0)
        check_number("spread_factor", self.spread_factor, 1.0)
        band = self.update_ratio_band
        expected, fix = "(low, high) with 0 < low < high", "e.g. update_ratio_band=(1e-4, 1e-2)"
        if not isinstance(band, Sequence) or isinstance(band, str) or len(band) != 2:
            raise TypeError(f"`update_ratio_band` must be {expected}, got {band!r} ({type(band).__name__}): {fix}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in band):
            raise TypeError(f"`update_ratio_band` must be {expected}, two numbers, got {band!r}: {fix}")
        if not all(math.isfinite(v) for v in band) or not 0 < band[0] < band[1]:
            raise ValueError(f"`update_ratio_band` must be {expected}, got {band!r}: {fix}")
        check_int("window", self.window, low=3)
        for name in ("max_attention_logit", "max_output_logit", "max_massive_ratio"):
            check_number(name, getattr(self, name), 0.0)
        check_number("min_entropy_fraction", self.min_entropy_fraction, 0.0, high=1.0)

    def titles(self) -> dict[str, str]:
        """Each problem's heading, with its threshold."""
        low, high = self.update_ratio_band
        return {key: text.format(low=low, high=high, **vars(self)) for key, text in PROBLEMS.items()}


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
            for problem in _FIGURE_PROBLEMS[figure]:
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
        now = sorted(((p, layer, e) for (p, layer), e in self.episodes.items() if e.ongoing), key=self._order)
        before = sorted(((p, layer, e) for (p, layer), e in self.episodes.items() if not e.ongoing), key=self._order)
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

    def _order(self, item: tuple[str, str, Episode]) -> tuple[int, int, int]:
        """Problem kind first, then the earliest episode (where it began), then depth."""
        problem, layer, episode = item
        return list(PROBLEMS).index(problem), episode.first, self._depth.get(layer, 0)


#: The problems each figure can show.
_FIGURE_PROBLEMS = {
    "zero_fraction": ("dead",), "nonfinite": ("nonfinite",), "ratio": ("too_fast", "too_slow"),
    "norm": ("nonfinite_grad", "exploding", "vanishing"),
    "attention_max_logit": ("attention_logits",), "attention_entropy": ("entropy_collapse",),
    "logit_abs_max": ("output_logits",), "massive_ratio": ("massive",),
}


def _worse(problem: str, value: float, than: float) -> bool:
    """Whether ``value`` is further outside the band of ``problem`` than ``than``."""
    if problem in ("vanishing", "too_slow", "entropy_collapse"):
        return value < than
    if problem.startswith("nonfinite"):
        return False
    return value > than
