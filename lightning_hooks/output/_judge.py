"""The one judge: which layer went wrong at a logged step, told apart from the layers it hurt (host-side, torch-free).

LayerHealth, the Layers tab and ``AnomalyReport.diagnosis`` all call :class:`Judge`, one logged
step at a time, with every judged figure of that step. How it decides (docs/verdicts.md):

- Each row (a module's activation std, a parameter's gradient norm or update ratio) against its
  own history, on a log scale: a robust level (the median of its last ``window`` logged values)
  and noise (their median absolute deviation, floored), and a two-sided CUSUM of its deviation
  from that level, so that a jump is caught at once and a slow ramp within a few points. While a
  row drifts away its level is frozen (a ramp cannot widen its own range); a drift too slow to
  add up to a finding within ``min_points`` points is learning, and becomes the row's level.
- An update ratio more than ``ratio_factor`` cubed (64) times the step's median ratio is too fast
  from the first logged step on: one param group's learning rate far above the others'. A cause
  of its own (a fault elsewhere does not change Adam's ``lr / rms(w)``), named beside the culprit.
- An update ratio above its own range but not above its first logged value is not too fast: Adam's
  first step moves every element by ``lr`` (``lr / rms(w)``, the most it moves a layer at that LR),
  and a ratio climbing back under it is Adam giving full steps to elements with no gradient history
  (units come alive near convergence), not a learning rate above the recipe's.
- A module's outputs are judged by its gain (its std over the std of the module before it in
  forward order) where that is ``QUIETER`` times quieter than its std: in a plain stack the batch
  moves every module's std together, and the module before it carries that share. A fault moves
  its own gain, not the gains after it. A gain's finding stands where the module's own std moved
  the same way (``_judge_gain.py``): a gain that moved against it is its input's move, unless the
  input's std leaned out only after the gain had (a loss shrinking the modules before a growing one:
  the gain led).
- Gradient norms and update ratios are judged against their peers too: the step's median change
  over all rows (the learning-rate schedule, the loss falling, the batch's own noise) is taken
  out first, so no fixed band judges the recipe; and a gradient's norm that moved as far as the same
  parameter's in the blocks before it in backward order (in their own range) is not named.
  Activations are not taken net of every row's move, where a single layer's fault would move
  every row downstream of it; a module's outputs
  that moved as far as its same-kind peers *before* it (in their own range) moved learned with
  them, and are not named (``_peers.py``; one leaning slowly, not yet named, by its move from its range where its
  window's is under the margin); the last copy of a kind ending a gradient over depth is
  excused while the copy before it moves, its range held until it stops too.
  Nor where its whole kind grew at once (every same-kind copy's outputs moved as far as a finding the
  same way) and its gain led none of its copies' (a network without normalisation under SGD).
  And a module whose outputs moved ``OUTPACE`` margins and as far ahead of every copy of its kind (three or
  more copies) is out whatever its own range says (a ramp its range took in as its trend): the first module
  before it in forward order that led its own copies as well (a third as far) is (``_outpaced``).
- The gradient reaching each module's output (``output_grad``, ActivationMonitor's
  ``gradients=True``) against its own history, net of the move of the last module's (the
  loss's own move: the loss falling, the batch, the schedule): the backward pass's gain from the
  loss to that module. The backward runs in reverse forward order, so a fault in one module's
  backward moves the gain of every module *before* it: of those out at a step, the *last* in
  forward order (the first the backward pass reached) is named, and only where no module's
  outputs single one out (a forward culprit moves the backward too: its consequences).
- Every layer at once is the batch, not a layer: the first module in forward order out (its
  input is the batch), or every gradient moving together, and staying there at the next logged
  step, while no activation, output gradient or update ratio singles a layer out (the labels): ``data``.
- Culprit and victims: the first module in forward order whose outputs are out (its inputs in
  range) is named; the modules after it, and other layers' gradients and ratios, are its victims.
  Without an output finding, the update ratio that moved most, then the gradient norm, is named.
  While a named layer is still out, the others that go out are counted as affected, not named.
- The prediction layer (the last module in forward order, whose output feeds the loss) growing
  while the loss asks for it is learning: its ``blowup`` is not named while its ``pull`` (LayerHealth's
  ``sum(y * dL/dy)`` of its output ``y``, ``dL/d(scale of y)``) is below 0 at the step, or the mean of its last
  ``PULL_POINTS`` is (one small batch's takes either sign). A fault that
  overshoots has it above 0 (the loss wants it smaller, yet it grows), and is named then; named
  first where it moved ``OVERSHOOT`` times as far as every module before it that is out (under
  SGD a jump's gradient moves their weights in the same step). A growth the loss asked for that
  stopped rising, the pull about 0 (no stronger than its strongest ask), waits and then settles as
  its range (``_judge_learning.py``: ``_asked_or_learned``); without a pull measured, judged as before.
- An embedding's outputs (``lookups``: rows of its own weight) drifting out no further than ``WEIGHT_SLACK`` times
  its weight's update ratio times the steps of its last points (a weight's norm moves at most by its update ratio a
  step) are its weights learning; without an update ratio logged there, any drift of theirs is
  (``_judge_learning.py``: ``_looked_up``). A step is judged as before. So are any other module's outputs, not
  the prediction layer's, whose own weight's update ratio is logged and whose share of the step's median ratio
  surged ``SURGE`` times its usual (its weights learning faster than the others'; under Adam a ratio's size is
  ``lr / rms(w)``, no sign).
- Absolute rules where the physics gives a bound (:mod:`~lightning_hooks.output._judge_absolute`):
  a NaN or Inf; ``ALL_ZERO`` exact zeros, or more than ``max_zero_fraction`` from the first logged point or
  for ``SPARSE_POINTS`` logged points in a row (dead units; a small batch's sparsity crosses it for one) with the
  live outputs fallen to ``DYING_SHARE`` of the most they were over ``DYING_STEPS`` (units dying, not a creep);
  TransformerStability's
  logit, entropy and massive-activation bounds. They judge from the first logged step.
- A module's outputs out of range, not named yet, whose lean slowed under ``CREEP_PER_STEP`` a step over its
  last points (``lean_slowed``: a layer's learning settling, within twice the least change) are not named.
- A norm's scale's update ratio (``SCALE_RATIO``) is judged against its own range apart from the other rows,
  named ``too_fast`` ``SCALE_JUMP`` times beyond it (an LR raised on the norm), then while it stays out.
- A step whose findings are only gradient norms out up at their first point, nothing named, names none:
  one batch's gradient landing in one layer; named at the second point out (``_lone_spikes``). So is a norm's first
  point past its bound on a lean ``LEAN_AGE`` steps old, within ``LEAN_WAIT`` times its bound (one batch on a slow
  lean, as for outputs below).
- Nor a step, nothing named, whose findings are modules' outputs that each rose at their first point out, within
  ``LEAN_WAIT`` times their bound (and lone gradient spikes), its culprit's lean ``LEAN_AGE`` steps old or more: one
  batch on a healthy layer's long lean; or its lean back within its range at the point before: a noisy row hopping
  out and in, no ramp's lean. The culprit waits for the next point, named there as if named at this one
  if its outputs are out still (``_first_leans``); a slow ramp costs a point.
- A row's own range judges from its ``min_points``-th value and ``WARM_STEPS_PER_POINT * min_points``
  steps on: the first steps move every layer, and no history tells learning from a fault there. Logged every
  few steps, from its ``COARSE_POINTS``-th value once its values span those steps (``in_warm_up``). Before that
  only a step is judged (``WARM_JUMP``); a module's gain's step stands for its outputs where its std's newest point
  went beyond its history the same way, half as far at least (``_stepped_with_gain``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Optional, Union

from lightning_hooks.output._findings import (
    BACKWARD,
    PARAMETER_FIGURES,
    RELATIVE,
    SCALE_RATIO,
    Finding,
    Judged,
    inner_first,
    layer_of,
)
from lightning_hooks.output._health_bands import Bands
from lightning_hooks.output._judge_absolute import ZeroRuns, absolute_problems
from lightning_hooks.output._judge_culprit import LEAN_SHARE, CulpritNaming, its_own
from lightning_hooks.output._judge_data import gradients_jumped_together, outputs_out_together, singled_out
from lightning_hooks.output._judge_gain import AGREE, GainJudging
from lightning_hooks.output._judge_learning import LEAN_POINTS, SHARED_FIGURES, LearningJudging
from lightning_hooks.output._judge_pull import ASK_POINTS, PULL
from lightning_hooks.output._peers import PEER_FIGURES, Peers
from lightning_hooks.output._row_range import (
    WARM_FALL,
    WARM_JUMP,
    WARM_POINTS,
    WARM_STEPS_PER_POINT,
    Track,
    came_back,
    hold_newest,
    in_warm_up,
    judge_value,
    least_change,
    track_from_state,
    track_state,
)

#: The relative figures whose step's common change over all rows is taken out (peers).
COMMON_MODE = ("norm", "ratio", "gain")
#: A norm's scale's update ratio is named past this many times beyond its own range (net of the other rows' common
#: move): its few entries move far more from step to step than a weight's; a param group's LR raised x100 moves it
#: about x100.
SCALE_JUMP = 10.0
#: Modules' outputs risen out at their first logged point no further than this many times a std's least change (x1.56
#: at the default ``level_factor``) wait for the next point, nothing named (``_first_leans``): a jump past it is named
#: at once, and any fall.
LEAN_WAIT = 2.0
#: ... where the culprit's outputs had leaned out of their range this many steps or more: a slow lean, learning's pace,
#: that one batch takes over its bound. A lean younger crossed it at a ramp's pace (the sweep's fault ramps crossed
#: within 4-10 steps of leaning; the healthy leans one batch took over, after 12-42).
LEAN_AGE = 12
#: An embedding's, or a weighted module's, weight's update ratios and their shares kept (``Judge.ratio_paths``,
#: ``Judge.ratio_shares``): logged every step, a window of outputs logged every 4.
RATIO_POINTS = 128


def lookup_rows(lookups: Union[Mapping[str, str], Collection[str]]) -> dict[str, str]:
    """The embeddings as ``{module: its weight's row}``; a module named alone has ``<module>.weight``."""
    if isinstance(lookups, Mapping):
        return {str(row): str(weight) for row, weight in lookups.items()}
    return {str(row): f"{row}.weight" for row in lookups}


class Judge(LearningJudging, GainJudging, CulpritNaming):
    """Judge each logged step's figures, layer by layer, against each layer's own history and its peers.

    Args:
        bands: The thresholds (see :class:`~lightning_hooks.output._health_bands.Bands`).
        order: The modules in forward order, if known; else the order their rows first come in.
        lookups: The modules whose outputs are rows of their own weights (the embeddings), if known, each with its
            weight's row (a name alone: ``<name>.weight``): a drift of their outputs as far as their weights moved is
            learning (``_judge_learning.py``: ``_looked_up``).
    """

    def __init__(self, bands: Bands, order: Sequence[str] = (),
                 lookups: Union[Mapping[str, str], Collection[str]] = ()) -> None:
        self.bands = bands
        self.depth: dict[str, int] = {name: i for i, name in enumerate(inner_first(order))}
        self.tracks: dict[str, dict[str, Track]] = {}
        self.last: dict[str, dict[str, float]] = {}  # by figure: each row's last finite log value
        self.offset: dict[str, float] = {}  # by figure: the peers' common path so far (log), taken out
        self.moves: dict[str, float] = {}  # by figure: the step's common move (log)
        self.levels: Mapping[str, float] = {}  # the step's activation std by module
        self.pulls: Mapping[str, float] = {}  # the step's pull by module (LayerHealth's, the prediction layer's)
        self.named: set[str] = set()  # layers named and still out
        self.affected: set[str] = set()  # rows out as victims, not named while they stay out
        self.excused: set[str] = set()  # "figure/row": the last of its kind excused as its gradient's end
        self.first_entropy: dict[str, float] = {}
        self.zeros = ZeroRuns()  # logged points in a row with most outputs zero, by module
        self.first_ratio: dict[str, float] = {}  # each row's first logged update ratio (Adam: lr / rms(w))
        self.fast_scales: set[str] = set()  # norms' scales named too fast and still out of their range
        self.outpacing: set[str] = set()  # the step's modules out for leading every copy of their kind
        self.outs_before: set[str] = set()  # the modules whose outputs were out at the last step that held them
        self.grads_before: set[str] = set()  # the gradient norms out up at the last step that held them
        self.waited: Optional[str] = None  # the culprit of the last such step, whose outputs waited (``_first_leans``)
        self.confirming = False  # whether ``waited`` is named through this step only to be judged so (``_confirm``)
        self.asked: dict[str, tuple[float, int]] = {}  # the prediction layer out since a growth asked for
        self.trained: set[str] = set()  # layers whose parameters' rows came in (gradient norms or update ratios)
        self.thawed: dict[str, int] = {}  # layers whose parameters' rows first came in later (a thaw), in its warm-up
        self.params_start: Optional[int] = None  # the first step that held any parameter's rows
        self.start: Optional[int] = None  # the first logged step judged
        self.last_step: Optional[int] = None  # the last logged step judged
        self.gap = 1  # the steps from the logged step before to this one
        self.seen: dict[str, dict[str, int]] = {}  # by figure: the step each row last came in (its own gap from it)
        self.warm = True  # whether the rows' own ranges judge at this step (past the warm-up in steps)
        self.peers = Peers(bands.window, WARM_POINTS)  # a warm-up step's peers judge it as they do later
        self.lookups = lookup_rows(lookups)  # embeddings: each module's weight's row
        self.weighted: dict[str, str] = {}  # other modules whose own weight's update ratio comes in: that row
        self.recent_pulls: dict[str, deque[float]] = {}  # by module: its last pulls (``_note_pulls``)
        self.recent_levels: dict[str, deque[float]] = {}  # by module: its last logged log stds, raw (``_carried``)
        self.paths: dict[str, deque[tuple[int, float]]] = {}  # by lookup or weighted: (step, log std) of its outputs
        self.ratio_paths: dict[str, deque[tuple[int, float]]] = {}  # ... and (step, update ratio) of its weight
        self.ratio_shares: dict[str, deque[tuple[int, float]]] = {}  # by weighted: (step, its ratio / step's median)
        self.points = 0  # the logged steps judged (the steps' count where no step number is given)

    def step(self, figures: Mapping[str, Mapping[str, float]], step: Optional[int] = None) -> Judged:
        """Judge one logged step.

        Args:
            figures: Per figure (``level``, ``norm``, ``ratio``, ``zero_fraction``, ``nonfinite`` or
                a TransformerStability figure), each row's value at the step.
            step: The step's number, if known: the rows' ranges judge from ``WARM_STEPS_PER_POINT *
                min_points`` steps after the first logged step on (and from their ``min_points``-th value).
        """
        self.points += 1
        if step is not None:
            self.gap = max(1, step - self.last_step) if self.last_step is not None else 1
            self.start, self.last_step = (step if self.start is None else self.start), step
            self.warm = step - self.start + 1 >= WARM_STEPS_PER_POINT * self.bands.min_points  # steps seen
        known = len(self.depth)
        for figure, rows in sorted(figures.items(), key=lambda item: item[0] in PARAMETER_FIGURES):
            for row in rows:  # a module figure's rows are modules; a parameter's belongs to its module
                self.depth.setdefault(self.layer(figure, row), len(self.depth))
        if len(self.depth) > known:  # rows as registered (no forward order known): a block after the layers inside it
            ranked = inner_first(sorted(self.depth, key=self.depth.__getitem__))
            self.depth.clear()
            self.depth.update((name, i) for i, name in enumerate(ranked))
        self._thaw(figures, step)
        self._note_paths(figures)
        found: list[Finding] = []
        self.moves, self.levels, self.pulls = {}, figures.get("level", {}), figures.get(PULL, {})
        self.outpacing = set()
        self._note_pulls(self.pulls)
        self._note_levels(self.levels)
        self._confirm("level" in figures)
        for figure, values in figures.items():
            if figure in (PULL, SCALE_RATIO):
                continue
            if figure in RELATIVE:
                found.extend(self._relative(figure, values))
            else:
                found.extend(self._absolute(figure, values))
        found.extend(self._scales(figures.get(SCALE_RATIO, {})))  # net of the step's common move of the ratios
        data = self._is_data(found, figures)
        judged = self._sort(self._first_leans(self._outputs(self._lone_spikes(found)), "level" in figures, data), data)
        if "norm" in figures:  # a row not logged at the step keeps its state (a router's expert not picked)
            self.grads_before = (self.grads_before - set(figures["norm"])) | {
                f.row for f in found if f.figure == "norm" and f.problem == RELATIVE["norm"][0]}
        return judged

    def _note_pulls(self, pulls: Mapping[str, float]) -> None:
        """Keep each module's last ``ASK_POINTS`` finite pulls (``_judge_learning.py``: ``_asked_or_learned``)."""
        for row, v in pulls.items():
            if math.isfinite(v):
                self.recent_pulls.setdefault(row, deque(maxlen=ASK_POINTS)).append(v)

    def _note_levels(self, levels: Mapping[str, float]) -> None:
        """Keep each module's last ``LEAN_POINTS`` log stds as logged, in or out of its range (``_carried``)."""
        for row, v in levels.items():
            if math.isfinite(v) and v > 0:
                self.recent_levels.setdefault(row, deque(maxlen=LEAN_POINTS)).append(math.log(v))

    def _note_paths(self, figures: Mapping[str, Mapping[str, float]]) -> None:
        """Note each embedding's, and each weighted module's, outputs' std and its weight's update ratio, as they come.

        Each on its own cadence (``_looked_up``): its weight's row as the gradient monitor names it (a tied weight's
        first name), or its module's (``granularity="module"``). A module whose ``<module>.weight`` (or own) ratio row
        comes in beside its std is weighted from then on; its ratio's share of the step's median ratio is kept too.
        """
        levels, ratios = figures.get("level", {}), figures.get("ratio", {})
        at = self.last_step if self.last_step is not None else self.points
        for row in levels:  # a module with a weight of its own whose update ratio comes in (``_weights_moved``)
            if row not in self.lookups and row not in self.weighted and (f"{row}.weight" in ratios or row in ratios):
                self.weighted[row] = f"{row}.weight" if f"{row}.weight" in ratios else row
        rates = [r for r in ratios.values() if math.isfinite(r) and r > 0]
        typical = statistics.median(rates) if len(rates) >= 3 else math.nan  # the step's usual update ratio
        for row, weight in {**self.weighted, **self.lookups}.items():  # an embedding noted once, as an embedding
            v, r = levels.get(row, math.nan), ratios.get(weight, ratios.get(row, math.nan))
            if math.isfinite(v) and v > 0:
                self.paths.setdefault(row, deque(maxlen=self.bands.window)).append((at, math.log(v)))
            if math.isfinite(r) and r >= 0:
                self.ratio_paths.setdefault(row, deque(maxlen=RATIO_POINTS)).append((at, r))
                if math.isfinite(typical) and row in self.weighted:
                    self.ratio_shares.setdefault(row, deque(maxlen=RATIO_POINTS)).append((at, r / typical))

    def _thaw(self, figures: Mapping[str, Mapping[str, float]], step: Optional[int]) -> None:
        """Note the layers whose parameters start training at ``step``: frozen before, their rows absent.

        A layer a fine-tuning run thaws (``requires_grad`` off, then on) moves its outputs as its first steps
        of training do, at the learning rate of the moment: its outputs are in a warm-up of their own
        (``_warm_for``). Only a layer that ran while frozen (its outputs, or those of a module inside it, hold
        ``min_points`` values: ``_ran``), after the first step that held any parameter's rows (a resumed judge,
        or gradients logged on their own cadence, start there): an expert first routed late has no outputs
        before, and is new, not thawed.
        """
        rows = [(figure, row) for figure in PARAMETER_FIGURES for row in figures.get(figure, ())]
        if not rows:
            return
        first = self.params_start is None
        if first:
            self.params_start = step
        span = WARM_STEPS_PER_POINT * self.bands.min_points
        if step is not None:  # a thaw's warm-up over: forgotten
            self.thawed = {layer: at for layer, at in self.thawed.items() if step - at < span}
        for figure, row in rows:
            layer = self.layer(figure, row)
            if layer in self.trained:
                continue
            self.trained.add(layer)
            if not first and step is not None and self._ran(layer):
                self.thawed[layer] = step

    def _ran(self, layer: str) -> bool:
        """Whether a layer's outputs, or those of a module inside it, hold ``min_points`` values (it ran before)."""
        inside = layer + "."
        return any(len(track.logs) >= self.bands.min_points
                   for row, track in self.tracks.get("level", {}).items() if row == layer or row.startswith(inside))

    def _warm_for(self, row: str) -> bool:
        """Whether a module's outputs are judged by their range at this step, past every warm-up that holds it.

        The judge's, and the warm-up of every layer thawed in, around or as the module (``_thaw``):
        ``WARM_STEPS_PER_POINT * min_points`` steps from its thaw.
        """
        return self.warm and not self._thawing(row)

    def _thawing(self, row: str) -> bool:
        """Whether a layer thawed in, around or as the module is in its warm-up (``_thaw``)."""
        return any(layer == row or layer.startswith(row + ".") or row.startswith(layer + ".") for layer in self.thawed)

    def _gap(self, figure: str, row: str) -> int:
        """The steps since a row of ``figure`` last came in (the judge's gap at its first).

        A monitor logging on a cadence of its own (activations every 20 beside gradients every step) gives its
        rows their own gaps.
        """
        seen = self.seen.setdefault(figure, {})
        step = self.last_step
        if step is None:
            return self.gap
        before = seen.get(row)
        seen[row] = step
        return self.gap if before is None else max(1, step - before)

    def _lone_spikes(self, found: list[Finding]) -> list[Finding]:
        """The findings, or none where they are only gradient norms out up at their first point, nothing named.

        One batch's gradient concentrated in one layer (a healthy Qwen2's keys: x14 for one step, every
        other layer's x2) is not a fault of the layer: named at its second point out. So is one batch taking a
        slow lean just over its bound: a norm out up at its first point (not out at the last step holding norms),
        within ``LEAN_WAIT`` times its bound, on a lean ``LEAN_AGE`` steps old or more (a plain CNN's head gradient
        at twice its LR, leaning for 40 steps, x4.2 for one point). Where anything else is out (its outputs,
        output gradient or update ratio, another layer), or a layer is named, it is judged at once with the rest:
        named with its own layer's, or counted as a victim.
        """
        spike, bound = RELATIVE["norm"][0], LEAN_WAIT * self._margin("norm", True)
        lone = [f for f in found if f.problem == spike and f.figure == "norm" and (
            len(self.tracks["norm"][f.row].held) < 2
            or (f.row not in self.grads_before and f.moved <= bound and self._long_lean(self.tracks["norm"][f.row])))]
        return found if self.named or len(lone) < len(found) else []

    def _first_leans(self, found: list[Finding], judged: bool, data: bool) -> list[Finding]:
        """The findings, less the modules' outputs where each rose at its first point out, within ``LEAN_WAIT``.

        One batch on a healthy layer's long lean (a transformer at twice its learning rate: one block's attention
        output x2 over 100 steps, as fast as the slowest fault ramps) takes it just past its bound for one logged point,
        and back at the next; a ramp's next point is further out. Where the culprit's outputs had leaned out of their
        range ``LEAN_AGE`` steps or more (a fault's ramp crosses sooner), or whose lean was back within their range at
        the point before (a noisy row hopping out and in: a ramp's points lean further out one after the other; a
        healthy GPT-2's attention output swinging x1.3 from batch to batch), such a step's outputs wait, its culprit
        noted (``waited``): named there, as it would have been at the step it waited, if its outputs are out still
        (their excuses judged again); the modules before it going out there within ``LEAN_WAIT`` bounds went out
        after it, its victims (one further out is judged as rule 5 of the culprit's says: a cause further up).
        Judged at once where any module's outputs went past ``LEAN_WAIT`` bounds (a jump: past x2 is abrupt) or
        fell (a fall's least change is twice a rise's already: x0.64, and a shrink to x0.5 is abrupt), were out at
        the last step, or lead every copy of their kind (a lead over 8 points); where any other row is out (not a
        lone gradient spike: ``_lone_spikes``), the culprit is the first module (the batch's step, named once it
        stays), the batch is named (data), or a layer is. The bound is a std's (x1.56 at the default
        ``level_factor``), for a module judged by its gain too. ``judged``: whether the step held the modules'
        outputs (``outs_before`` is their last such step's).
        """
        if not judged:
            return found
        outputs = [f for f in found if f.problem in RELATIVE["level"]]
        before, self.outs_before = self.outs_before, {f.row for f in outputs}
        waited, self.waited = self.waited, None
        if waited is not None:  # named through the step (``_confirm``): its outputs out still, or not named
            if any(f.layer == waited for f in outputs):
                top = self.depth.get(waited, 0)  # the modules before it going out now went out after it
                self.affected |= {f.row for f in outputs if self.depth.get(f.layer, 0) < top
                                  and abs(f.moved) <= LEAN_WAIT * self._margin("level", f.moved > 0)}
                return found
            if self.confirming:
                self.named.discard(waited)
                found = self._lone_spikes(found)
        if self.named or data or not outputs:
            return found
        bound = self._margin("level", True)
        if not all(f.row not in before and f.row not in self.outpacing and 0 < f.moved <= LEAN_WAIT * bound
                   for f in outputs):
            return found
        culprit = self._culprit([f for f in found if f.row not in self.affected and f.figure in RELATIVE])
        track = self._track(culprit) if culprit is not None else None
        if culprit == self._first() or track is None or not (self._long_lean(track) or came_back(track)):
            return found  # the batch's step, named once it stays (``_sort``); or a lean as young as a ramp's
        rest = self._lone_spikes([f for f in found if f.problem not in RELATIVE["level"]])
        if any(f.figure in RELATIVE for f in rest):  # other rows out beside them: judged at once
            return found
        self.waited = culprit
        return rest

    def _long_lean(self, track: Track) -> bool:
        """Whether ``track`` has held its range (leaned out of it) ``LEAN_AGE`` steps or more: no fault's ramp."""
        return len(track.held) * self.gap >= LEAN_AGE

    def _confirm(self, judged: bool) -> None:
        """The culprit whose outputs waited at the last step is judged as named at this one (``_first_leans``).

        As it would have been, named at the step it waited: a named layer's outputs are judged by their own move (no
        excuse a module not named has lets them in), and stay named while out.
        """
        self.confirming = judged and self.waited is not None and self.waited not in self.named
        if self.confirming:
            self.named.add(self.waited)

    def _outputs(self, found: list[Finding]) -> list[Finding]:
        """Each module's outputs judged by its gain where that is the quieter figure (see the module docstring)."""
        gains = self._relative("gain", self._gains())
        by_gain = {row for row in self.levels if self._judged_by(row) == "gain"} - self.outpacing
        self._follow_input([f for f in found if f.problem in RELATIVE["level"] and f.row in by_gain], gains)
        kept = self._stacked([f for f in found if not (f.problem in RELATIVE["level"] and f.row in by_gain)])
        levels_out = {f.row for f in kept if f.problem in RELATIVE["level"]}
        stepped = {f.row for f in gains if f.row not in levels_out and self._stepped_with_gain(f)}
        for row in stepped:  # the std's point held back, as a step of its own is: named while it stays out
            hold_newest(self.tracks["level"][row], math.log(self.levels[row]))
        by_gain |= stepped
        kept += [Finding(f.row, f.layer, f.problem, self.levels[f.row], "level", f.moved)
                 for f in self._stacked([f for f in gains if f.row in by_gain])
                 if f.row in self.named or self._level_agrees(f)]
        out, inputs = {f.row for f in kept if f.figure == "level"}, self._before()
        kept = [f for f in kept
                if f.row in by_gain or f.layer in self.named or not self._input_carried(f, out, inputs)]
        last = self._last()
        out_now = {f.row for f in kept if f.problem == "blowup"}  # back in range: a growth asked for ended
        self.asked = {row: ask for row, ask in self.asked.items() if row in out_now}
        kept = [f for f in kept if not self._let_in(f, self._asked_or_learned(f, last)) and not self._slowed(f)]
        kept = self._looked_up(self._carried(kept, last, inputs), last)
        out = {f.row for f in kept}
        return [self._inward(f, out) for f in kept]

    def _stepped_with_gain(self, found: Finding) -> bool:
        """Whether a module's std, in its warm-up, stepped its gain's way with it: the gain's early jump is theirs.

        Before either figure's noise is measured a module's outputs are judged by their std (``_track``), whose
        early jump is measured against every value its history holds, the early learning's peak among them; its
        gain's (its input's move taken out) stands for them where the std's newest point went beyond every value
        its history holds the same way, ``AGREE`` of the gain's move at least (the module's own step, not its input
        falling away under it), and not past ``WARM_JUMP`` (``WARM_FALL`` down) itself: a step of the std's own is
        judged as its own, its excuses with it. The std's point is held back then (``_outputs``), named while it stays
        out. A U-Net's middle convolution x7.9 at step 59, logged every 5 (its 12th point): its std x5.6 in one point
        but x4.67 above its step-19 peak, under ``WARM_JUMP``; its gain x5.2 above its own.
        """
        track, level = self.tracks.get("level", {}).get(found.row), self.levels.get(found.row, 0.0)
        if track is None or not level > 0:
            return False
        x = math.log(level)
        joined = bool(track.logs) and track.logs[-1] == x  # the std's point joined its history: no jump of its own
        if not (in_warm_up(track, self.bands, joined) or not self._warm_for(found.row)):
            return False
        history = list(track.logs)[:-1] if joined else list(track.logs)
        if not history:
            return False
        sign = 1.0 if found.moved > 0 else -1.0
        beyond = sign * (x - (max(history) if sign > 0 else min(history)))
        return AGREE * abs(found.moved) <= beyond < (WARM_JUMP if sign > 0 else WARM_FALL)

    def _relative(self, figure: str, values: Mapping[str, float]) -> list[Finding]:
        tracks, last = self.tracks.setdefault(figure, {}), self.last.setdefault(figure, {})
        logs = {row: (math.log(v) if v > 0 else -math.inf) for row, v in values.items() if math.isfinite(v) and v >= 0}
        blocks = self._containers() if figure == "gain" else ()  # a block's gain is no part of the layers' common move
        moves = [logs[r] - last[r] for r in logs if r in last and math.isfinite(logs[r]) and r not in blocks]
        common = statistics.median(moves) if figure in COMMON_MODE and len(moves) >= 3 else 0.0
        if figure == BACKWARD:  # the gain from the loss: the loss-side row's own move taken out
            common = self._loss_side_move(logs, last)
        self.moves[figure] = common
        self.offset[figure] = self.offset.get(figure, 0.0) + common  # the peers' path, taken out
        found = [Finding(row, self.layer(figure, row), "nonfinite_grad", v, figure, math.inf)  # moved past any bound
                 for row, v in values.items() if figure == "norm" and not math.isfinite(v)]
        finite = [x for x in logs.values() if math.isfinite(x)]
        if figure == "ratio" and len(finite) >= 3:  # far above its peers from the start: no history needed
            typical = statistics.median(finite)
            found += [Finding(row, self.layer(figure, row), "too_fast", values[row], "peers", x - typical)
                      for row, x in logs.items() if x - typical > 3 * math.log(self.bands.ratio_factor)]
        if figure == "ratio":
            for row, v in values.items():
                if math.isfinite(v) and v > 0:
                    self.first_ratio.setdefault(row, v)
        if figure in SHARED_FIGURES:
            self.peers.add(figure, {row: x - self.offset[figure] for row, x in logs.items()})
        for row, x in logs.items():
            if math.isfinite(x):
                last[row] = x
            track = tracks.setdefault(row, Track(deque(maxlen=self.bands.window)))
            as_ = "level" if row in blocks else figure  # a block's gain: as far as a level must move
            warm = self._warm_for(row) if figure in PEER_FIGURES else self.warm
            moved = judge_value(track, x - self.offset[figure], as_, self.bands, warm, self._gap(figure, row))
            if moved is not None and not self._under_first_ratio(figure, row, values[row], moved):
                up, down = RELATIVE[figure]
                found.append(Finding(row, self.layer(figure, row), up if moved > 0 else down, values[row], figure,
                                     moved))
        if figure == "level":
            found += self._outpaced(values, {f.row for f in found})
        found = self._unshared(figure, found)
        if figure == "level":  # an outpacing module excused (its peers, a gradient over depth) is not out
            self.outpacing &= {f.row for f in found}
        return found

    def _outpaced(self, values: Mapping[str, float], out: Collection[str]) -> list[Finding]:
        """The modules whose outputs moved far ahead of every copy of their kind, not out of their own range yet.

        (``Peers.outpaced``): a ramp its own range took in as its trend. Each one traced back through the modules
        before it in forward order that moved its way and led their own copies so, past one least change and at least
        1/``LEAN_SHARE`` as far (a gated MLP's product of two projections of one input moves twice as far as a ramp
        in the norm before it, and leads its copies first): the first of them is out. ``moved``: how far ahead. Not
        a module in a thaw's warm-up (``_thaw``: a layer a fine-tune starts training moves ahead of its copies).
        """
        leads, margin = self.peers.leads("level"), least_change("level", self.bands)
        ahead = self.peers.outpaced("level", margin, leads)
        if not ahead:
            return []
        before, found = self._before(), {}
        up, down = RELATIVE["level"]
        for row, lead in ahead.items():
            sign, least = (1 if lead > 0 else -1), max(margin, abs(lead) / LEAN_SHARE)
            while (prev := before.get(row)) in leads and sign * leads[prev][0] > 0 and sign * leads[prev][1] >= least:
                row = prev
            if row not in out and math.isfinite(values.get(row, math.nan)) and not self._thawing(row):
                found[row] = Finding(row, self.layer("level", row), up if sign > 0 else down, values[row], "level",
                                     leads[row][1])
        self.outpacing = set(found)  # a module judged by its gain too: its std's lead is what is out
        return list(found.values())

    def _scales(self, values: Mapping[str, float]) -> list[Finding]:
        """Each norm's scale whose update ratio went ``SCALE_JUMP`` times beyond its own range: ``too_fast``.

        Judged as a ratio is (its range, net of the other rows' common move), named only that far out: a
        param group's learning rate raised on a norm shows there alone (its outputs move a few %).
        """
        tracks, found = self.tracks.setdefault(SCALE_RATIO, {}), []
        for row, v in values.items():
            if not (math.isfinite(v) and v > 0):
                continue
            track = tracks.setdefault(row, Track(deque(maxlen=self.bands.window)))
            x = math.log(v) - self.offset.get("ratio", 0.0)
            moved = judge_value(track, x, "ratio", self.bands, self.warm, self._gap(SCALE_RATIO, row))
            if moved is not None and moved > (0.0 if row in self.fast_scales else math.log(SCALE_JUMP)):
                found.append(Finding(row, self.layer(SCALE_RATIO, row), RELATIVE["ratio"][0], v, "ratio", moved))
        self.fast_scales = (self.fast_scales - set(values)) | {f.row for f in found}  # named stays named while out
        return found

    def _under_first_ratio(self, figure: str, row: str, value: float, moved: float) -> bool:
        """Whether an update ratio's rise is no higher than its first logged value (see the module docstring)."""
        if figure != "ratio":
            return False
        return moved > 0 and value <= self.first_ratio.get(row, 0.0)

    def _is_data(self, found: list[Finding], figures: Mapping[str, Mapping[str, float]]) -> bool:
        """Every layer at once, the batch rather than a layer (:mod:`~lightning_hooks.output._judge_data`)."""
        levels = figures.get("level", {})
        first = self._first() if len(levels) >= 3 else None
        if first is not None and (not self._left_by_a_step(first) or its_own(first, found)):
            first = None  # a ramp out of the first module, or its own fault: not the batch's step
        if outputs_out_together(found, levels, first):
            return True
        if len(figures.get("norm", ())) < 3 or singled_out(found):
            return False
        common = self.tracks.setdefault("common", {}).setdefault("norm", Track(deque(maxlen=self.bands.window)))
        return gradients_jumped_together(common, self.moves.get("norm", 0.0), self.offset["norm"], self.bands)

    def _loss_side_move(self, logs: Mapping[str, float], last: Mapping[str, float]) -> float:
        """The move (log) of the gradient reaching the last module's output since its last value, or 0.

        The last module in forward order is the loss's side: its gradient is the loss's own; the
        others' against it are the backward pass's gain, which a cut or a blow-up changes.
        """
        finite = [row for row, x in logs.items() if math.isfinite(x)]
        side = max(finite, key=lambda row: self.depth.get(row, 0)) if finite else None
        return logs[side] - last[side] if side is not None and side in last else 0.0

    def _absolute(self, figure: str, values: Mapping[str, float]) -> list[Finding]:
        judged_as = "level" if figure in ("nonfinite", "zero_fraction") else figure
        return [Finding(row, self.layer(judged_as, row), problem, v, judged_as)
                for row, problem, v in absolute_problems(figure, values, self.bands, self.first_entropy, self.zeros,
                                                         self.points if self.last_step is None else self.last_step,
                                                         self._from_start())]

    def _from_start(self) -> bool:
        """Whether this judge saw the run from its start: its first logged step within its warm-up in steps.

        A resumed fit's judge starts afresh (LayerHealth keeps no state across fits): its first point is not the
        module's first.
        """
        return self.start is not None and self.start < WARM_STEPS_PER_POINT * self.bands.min_points

    def layer(self, figure: str, row: str) -> str:
        """The layer a row of ``figure`` belongs to: a parameter's row is its module's."""
        return layer_of(row, self.depth) if figure in PARAMETER_FIGURES else row

    def usual(self, figure: str, row: str) -> float | None:
        """A row's usual value of a relative figure (its level, with the peers' path put back), or None."""
        track = self.tracks.get(figure, {}).get(row)
        if track is None and figure == "ratio":  # a norm's scale: its ratio's range is kept apart
            track = self.tracks.get(SCALE_RATIO, {}).get(row)
        if track is None or in_warm_up(track, self.bands):
            return None
        return math.exp(statistics.median(track.logs) + self.offset.get(figure, 0.0))

    def gain(self, row: str) -> tuple[str, float, float] | None:
        """Where a module's outputs are judged by their gain: the module before it, the gain now and its usual.

        None where its outputs are judged by their own std, or the gain has too little history.
        """
        before, now, usual = self._before().get(row), self._gains().get(row), self.usual("gain", row)
        if before is None or now is None or usual is None or self._judged_by(row) != "gain":
            return None
        return before, now, usual

    def state_dict(self) -> dict[str, Any]:
        """The judge's memory, as plain values."""
        return {"depth": dict(self.depth), "last": {f: dict(v) for f, v in self.last.items()},
                "offset": dict(self.offset), "start": self.start, "last_step": self.last_step, "gap": self.gap,
                "tracks": {f: {r: track_state(t) for r, t in rows.items()} for f, rows in self.tracks.items()},
                "named": sorted(self.named), "affected": sorted(self.affected), "excused": sorted(self.excused),
                "first_entropy": dict(self.first_entropy), "zeros": self.zeros.state_dict(),
                "first_ratio": dict(self.first_ratio),
                "paths": {row: [list(point) for point in path] for row, path in self.paths.items()},
                "ratio_paths": {row: [list(point) for point in path] for row, path in self.ratio_paths.items()},
                "ratio_shares": {row: [list(point) for point in path] for row, path in self.ratio_shares.items()},
                "weighted": dict(self.weighted),
                "points": self.points,
                "recent_pulls": {row: list(pulls) for row, pulls in self.recent_pulls.items()},
                "recent_levels": {row: list(logs) for row, logs in self.recent_levels.items()},
                "fast_scales": sorted(self.fast_scales), "outs_before": sorted(self.outs_before),
                "grads_before": sorted(self.grads_before), "waited": self.waited,
                "asked": {row: list(v) for row, v in self.asked.items()},
                "trained": sorted(self.trained), "thawed": dict(self.thawed), "params_start": self.params_start,
                "seen": {f: dict(rows) for f, rows in self.seen.items()},
                "peers": self.peers.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.depth = dict(state["depth"])
        self.last = {f: dict(v) for f, v in state["last"].items()}
        self.offset, self.start = dict(state["offset"]), state["start"]
        self.last_step, self.gap = state["last_step"], state["gap"]
        self.tracks = {f: {r: track_from_state(t, self.bands.window) for r, t in rows.items()}
                       for f, rows in state["tracks"].items()}
        self.named, self.affected = set(state["named"]), set(state["affected"])
        self.excused = set(state["excused"])
        self.first_entropy, self.zeros = dict(state["first_entropy"]), ZeroRuns.from_state(state["zeros"])
        self.first_ratio = dict(state["first_ratio"])
        self.paths = {row: deque(((int(at), float(x)) for at, x in path), maxlen=self.bands.window)
                      for row, path in state.get("paths", {}).items()}
        self.ratio_paths = {row: deque(((int(at), float(r)) for at, r in path), maxlen=RATIO_POINTS)
                            for row, path in state.get("ratio_paths", {}).items()}
        self.ratio_shares = {row: deque(((int(at), float(r)) for at, r in path), maxlen=RATIO_POINTS)
                             for row, path in state.get("ratio_shares", {}).items()}
        self.weighted = {str(row): str(weight) for row, weight in state.get("weighted", {}).items()}
        self.points = int(state.get("points", 0))
        self.recent_pulls = {row: deque(pulls, maxlen=ASK_POINTS)
                             for row, pulls in state.get("recent_pulls", {}).items()}
        self.recent_levels = {row: deque(logs, maxlen=LEAN_POINTS)
                              for row, logs in state.get("recent_levels", {}).items()}
        self.fast_scales = set(state["fast_scales"])
        self.outs_before, self.waited = set(state.get("outs_before", ())), state.get("waited")
        self.grads_before = set(state.get("grads_before", ()))
        self.asked = {row: (float(ask), int(waited)) for row, (ask, waited) in state["asked"].items()}
        # A state saved before thaws were noted (none released): the next step's parameter rows start afresh.
        self.trained, self.params_start = set(state.get("trained", ())), state.get("params_start")
        self.thawed = {row: int(at) for row, at in state.get("thawed", {}).items()}
        self.seen = {f: {row: int(at) for row, at in rows.items()} for f, rows in state.get("seen", {}).items()}
        self.peers.load_state_dict(state["peers"])
