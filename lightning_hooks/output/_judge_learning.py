"""Which of the judge's findings are a layer learning, not a fault (host-side, torch-free).

A part of :class:`~lightning_hooks.output._judge.Judge` (docs/verdicts.md, "How a layer is judged against its
own history"): a move its same-kind peers before it share (the recipe), a whole kind growing together, a
prediction layer's step the loss asked for in the warm-up, and a lean that slowed under the creep bound are
not named; the first three have the row's range follow the move, as it follows the row's own learning.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Optional

from lightning_hooks.output._findings import RELATIVE, Finding
from lightning_hooks.output._health_bands import Bands
from lightning_hooks.output._judge_pull import PULL_POINTS, prediction_blowup
from lightning_hooks.output._peers import PEER_FIGURES
from lightning_hooks.output._row_range import (
    MIN_NOISE,
    Track,
    follow,
    in_warm_up,
    lean_slowed,
    least_change,
    settle_at,
)

#: The figures whose moves the same-kind peers before a row excuse: its outputs' (``PEER_FIGURES``), and its
#: gradient's norm (peers in backward order).
SHARED_FIGURES = (*PEER_FIGURES, "norm")
#: The prediction layer's growth the loss asked for has settled at the scale the loss wanted after this many logged
#: points without the loss asking, its output not rising (``_asked_or_learned``): its ranges follow it then.
SETTLED = 4
#: A module's outputs rising while the prediction layer's rose this many times as far (log) over the same
#: ``CARRY_POINTS`` moves (their last ``CARRY_POINTS + 1`` logged points) are carried by the network's learning to
#: the targets' scale (``_carried``).
CARRY = 2.0
CARRY_POINTS = 8
#: ... and rose at least this far (log: x2), from the median of its first 3 of those points to that of its last 3.
CARRY_LEAST = math.log(2.0)
#: ... and the prediction layer's input rose this many times as far as the module: the layers between them grew too.
CARRY_INPUT = 1.2
#: A module's last logged stds kept (``recent_levels``): a lean up to this many points (a window's, and the point
#: before it) is compared over its whole span (``_carried``).
LEAN_POINTS = 33
#: An embedding's outputs are judged against its weight's updates over this many logged moves at least.
LOOKBACK = 3
#: An embedding's outputs drifting no further than this many times its weight's updates moved (its update ratio times
#: the steps) are learning: the used rows' share of the update can exceed the whole weight's.
WEIGHT_SLACK = 2.0
#: A module that is no embedding is so judged only where its weight's update ratio's share (over the step's median
#: ratio) over the span is this many times its usual share, the lower quartile of the ``window`` before it (at least
#: ``SURGE_POINTS``; a learning phase that goes on keeps its surge): its weights learning faster than the others', as
#: a layer's do when it starts to learn a feature (a GroupNorm CNN's first conv under SGD at LR 0.1: its ratio x10 in
#: 16 steps, the others' x2-3, its outputs x2.6).
#: Not its size alone: under Adam a layer's ratio is about ``lr / rms(w)`` whatever its gradient (2-4% a step in the
#: sweep's transformers at twice their LR), and a schedule's warm-up moves every layer's together.
SURGE = 2.0
SURGE_POINTS = 4


def _rise(logs: Sequence[float]) -> float:
    """How far a row rose over its points (log): from the median of its first 3 to the median of its last 3."""
    return statistics.median(logs[-3:]) - statistics.median(logs[:3])


class LearningJudging:
    """The rules that excuse a move as learning, mixed into :class:`~lightning_hooks.output._judge.Judge`.

    It reads the judge's state, which the judge keeps (``_judge.py``), and the culprit's rules on peers
    (``_judge_culprit.py``: ``_track``, ``_judged_by``, ``_with_peers``, ``_grew_with_kind``, ``_excused``).
    """

    bands: Bands
    tracks: dict[str, dict[str, Track]]  # by figure, by row: its range
    named: set[str]  # layers named and still out
    affected: set[str]  # rows out as victims
    warm: bool  # whether the rows' own ranges judge at this step (past the warm-up in steps)
    _warm_for: Callable[[str], bool]  # whether a module's outputs are past every warm-up holding it (a thaw's too)
    levels: Mapping[str, float]  # the step's activation std by module
    lookups: Mapping[str, str]  # modules whose outputs are rows of their own weights (embeddings): their weights' rows
    weighted: Mapping[str, str]  # other modules whose own weight's update ratio comes in: that row
    paths: Mapping[str, Sequence[tuple[int, float]]]  # by lookup or weighted module: (step, log std) of its outputs
    ratio_paths: Mapping[str, Sequence[tuple[int, float]]]  # ... and (step, update ratio) of its weight
    ratio_shares: Mapping[str, Sequence[tuple[int, float]]]  # by weighted module: (step, its ratio / the step's median)
    _track: Callable[[str], Optional[Track]]  # the track a module's outputs are judged by
    _before: Callable[[], dict[str, str]]  # each module by the one before it in forward order (``_judge_gain.py``)
    _left_by_a_step: Callable[[str], bool]  # whether a module's outputs left their range by a step
    gap: int  # the steps from the logged step before to this one
    pulls: Mapping[str, float]  # the step's pull by module (the prediction layer's)
    recent_pulls: Mapping[str, Sequence[float]]  # by module: its last pulls, this step's last
    recent_levels: Mapping[str, Sequence[float]]  # by module: its last LEAN_POINTS log stds, this step's last
    asked: dict[str, tuple[float, int]]  # the prediction layer out since a growth the loss asked for: its strongest
    # ask, and the points it has waited since, the loss no longer asking, its output not rising

    def _let_in(self, found: Finding, learned: bool) -> bool:
        """``learned``; if so, in the warm-up, the ranges of ``found``'s module follow its move (early learning).

        Later a move the loss asks for stays held: named once the loss no longer asks for it.
        """
        for track in self._output_tracks(found.row):
            if learned and (not self._warm_for(found.row) or in_warm_up(track, self.bands)):
                follow(track, self.bands.window)
        return learned

    def _looked_up(self, found: list[Finding], last: str | None) -> list[Finding]:
        """``found`` less the outputs drifting out as far as their own weights moved: learning, ranges follow.

        An embedding's (its outputs are its weights' rows), or a module's with a weight of its own whose update ratio
        is logged over the drift (``weighted``), not the prediction layer's (its pull judges it). Not one named
        already, nor one that left its range by a step (a fault's jump moves its weight's gradient in the same step).
        """
        kept = []
        for f in found:
            own = f.row in self.lookups or (f.row in self.weighted and f.row != last)
            if (own and f.problem in RELATIVE["level"] and f.layer not in self.named
                    and not self._left_by_a_step(f.row) and self._weights_moved(f.row)):
                for track in self._output_tracks(f.row):
                    follow(track, self.bands.window)
            else:
                kept.append(f)
        return kept

    def _carried(self, found: list[Finding], last: str | None, inputs: Mapping[str, str]) -> list[Finding]:
        """``found`` less the outputs rising as the network learns its targets' scale: their ranges follow.

        A module's ``blowup`` not named yet, before the prediction layer (``last``), where over their last
        ``CARRY_POINTS + 1`` logged points (each of the three's std in at this step) the prediction layer's outputs
        rose at least x2 and ``CARRY`` times as far (log, from the median of the first 3 points to that of the last
        3: one batch's noise is no rise) as the module's rise or its distance beyond its range, whichever is more,
        and the prediction layer's input (the module before it) ``CARRY_INPUT`` times as far as that: the whole
        network growing to fit the targets, the layers nearer the loss more (the sweep's GELU and SiLU MLPs at half
        their LR: the head x50 over 16 points, ``model.4`` x1.5-1.8 with it, the head's input twice as far). A fault
        carries the layers after it about as far as itself (their gain holds), where the prediction layer itself
        may rise more, still learning its scale: a RAdam MLP's ``model.4`` ramping 4% a step from step 100 while its
        head grew x17 (pull below 0), the head three times as far as the ramp, but the head's input less far than
        the ramp; named at its first points out, as before. A prediction layer that rose by a jump (more than half
        its raw rise, newest point against oldest, in one point) carries nothing. ``inputs``: ``_before()`` at the step.

        A module that has held its range for ``CARRY_POINTS + 1`` points or more (``held``: its values since it
        left, not by a step) is judged so over the points since it left too (its last ``LEAN_POINTS``), its rise
        measured over them as the others' are, not its distance beyond its range, whose level lags the slow lean it
        took inside the range before it left: a healthy pre-activation ResNet at twice its LR, its last block's input
        out for 9 points, x1.6 over them and x2.2 beyond its range, the head x3.4 and the head's input x2.8 over them
        (x3.4 is under twice x2.2 in log).
        """
        head = list(self.recent_levels.get(last, ())) if self._fresh(last) else []
        feed_row = inputs.get(last or "", "")  # the prediction layer's input
        feed = list(self.recent_levels.get(feed_row, ())) if self._fresh(feed_row) else []
        kept = []
        for f in found:
            if f.problem == "blowup" and f.row != last and f.layer not in self.named:
                own = list(self.recent_levels.get(f.row, ())) if self._fresh(f.row) else []
                if self._carried_by(f, own, head, feed):
                    for track in self._output_tracks(f.row):
                        follow(track, self.bands.window)
                    continue
            kept.append(f)
        return kept

    def _carried_by(self, found: Finding, own: Sequence[float], head: Sequence[float], feed: Sequence[float]) -> bool:
        """Whether ``found``'s module rose as the network learning its scale carries it (``_carried``).

        Over the last ``CARRY_POINTS + 1`` points (its rise at least its distance beyond its range), or over its
        lean's points where it held its range longer (its rise over them; the last ``LEAN_POINTS`` of a longer lean),
        not where it left its range by a step (a rise in one point, which the median of a span's first points does
        not see). ``own``, ``head``, ``feed``: the recent log stds of the module, the prediction layer and its input,
        each this step's last (empty where not in at the step).
        """
        track = self._track(found.row)
        lean = len(track.held) + 1 if track is not None else 0  # the point before it left, and those held since
        lean = min(lean, len(own), len(head), len(feed))  # a lean longer than the points kept: over those kept
        spans = [(CARRY_POINTS + 1, found.moved)]
        if lean > CARRY_POINTS + 1 and not self._left_by_a_step(found.row):  # a step's rise is in one point: no lean
            spans.append((lean, 0.0))
        for points, beyond in spans:
            if min(len(own), len(head), len(feed)) < points:
                continue
            window = head[-points:]
            head_rise = _rise(window)
            # Grown at least x2, over the points, not in one: a jump in the prediction layer carries nothing before it.
            if head_rise < CARRY_LEAST or max(b - a for a, b in zip(window, window[1:])) > (window[-1] - window[0]) / 2:
                continue
            rise = max(_rise(own[-points:]), beyond)
            if head_rise >= CARRY * rise and _rise(feed[-points:]) >= CARRY_INPUT * rise:
                return True
        return False

    def _fresh(self, row: str | None) -> bool:
        """Whether a module's std came in at this step, finite and above 0: its newest noted point is this step's."""
        value = self.levels.get(row, math.nan) if row is not None else math.nan
        return math.isfinite(value) and value > 0

    def _weights_moved(self, row: str) -> bool:
        """Whether a module's outputs moved no further than ``WEIGHT_SLACK`` times its weight's updates did.

        Over its last ``LOOKBACK`` moves (more while it has held more out): the log move of its std against its
        weight's update ratio (the mean of those logged over the span, on their own cadence) times the span's steps,
        the most a weight's norm can move. Without an update ratio logged over the span, an embedding's drift is its
        weights' anyway (nothing else moves a lookup's outputs): learning; another module's is not. Another module's
        updates must have surged too: its ratio's share of the step's median, over the span, ``SURGE`` times its
        lower quartile over the ``window`` of output points before the span (in steps: each on its own cadence).
        """
        track = self._track(row)
        held = len(track.held) if track is not None else 0
        span = list(self.paths.get(row, ()))[-(max(held, LOOKBACK) + 1):]
        if len(span) < 2:
            return row in self.lookups
        (start, first), (end, last) = span[0], span[-1]
        rates = [ratio for at, ratio in self.ratio_paths.get(row, ()) if start < at <= end]
        if not rates:
            return row in self.lookups
        rate = sum(rates) / len(rates)
        if row not in self.lookups:  # its updates surged against the others' over the span: its weights learning
            shares = self.ratio_shares.get(row, ())
            horizon = start - self.bands.window * (end - start) / (len(span) - 1)  # a window of output points
            now = [share for at, share in shares if start < at <= end]
            before = sorted(share for at, share in shares if horizon < at <= start)
            usual = before[len(before) // 4] if len(before) >= SURGE_POINTS else 0.0
            if not now or not usual > 0 or sum(now) / len(now) < SURGE * usual:
                return False
        return abs(last - first) <= WEIGHT_SLACK * (end - start) * rate

    def _output_tracks(self, row: str) -> list[Track]:
        """A module's outputs' tracks: its std's and its gain's, those it has."""
        return [track for figure in ("level", "gain") if (track := self.tracks.get(figure, {}).get(row)) is not None]

    def _asked_or_learned(self, found: Finding, last: str | None) -> bool:
        """Whether ``found`` is the prediction layer's growth the loss asks for, or asked for and now settling.

        While the pull is below 0 at the step, or the mean of its last ``PULL_POINTS`` is (one small batch's takes
        either sign), its ``blowup`` is learning (the loss asks for it). Once the loss stops asking
        (its pull at or above 0 but no stronger than its strongest ask: about 0, either sign from batch to
        batch) with the output not clearly rising (its newest value within its noise, at least ``MIN_NOISE``, of
        the highest it held out before the wait: a head whose std wanders 15% creeps in steps of that), it may have
        reached the scale the loss wanted: not named while it so waits, and after
        ``SETTLED`` such points (points where the loss still asks do not count) its ranges settle at the level it
        reached, without the growth as a trend (the
        sweep's 256-wide MLP under SGD: its output x7 over 16 steps, the pull down to -0.14, the loss 0.25
        -> 0.05, then flat with pulls of -0.07 to +0.11, named at the first above 0). One clearly rising,
        or pushed back harder than it was asked, while the loss asks for less overshoots: named (a ramp in
        it is named 2 steps later than at its first pull above 0). Without a pull at the step: as before. At its
        first point out, unless it went half its way out in that point, its strongest ask counts from its last
        ``ASK_POINTS`` pulls: a growth asked for in the judge's warm-up was let in there, unremembered (the sweep's
        GroupNorm CNN at LR 0.1: x5 asked for in the warm-up, then one batch's pull of +0.002 at the first point
        past it); a jump's pull is about 0 (a classifier's saturated loss), its ask before it no reason to let it
        go (the sweep's CNN with its head jumping x20).
        """
        if not prediction_blowup(found, last, self.named) or found.row not in self.pulls:
            return False  # not the prediction layer, named already, or its pull not measured: judged as before
        pull = self.pulls[found.row]
        asks = list(self.recent_pulls.get(found.row) or [pull])
        recent = asks[-PULL_POINTS:]
        # First out, not by a step: the loss's ask over its last points counts (a growth it asked for in the warm-up
        # was let in); a jump's own batch saturates the loss (its pull about 0): judged as before.
        levels = self.recent_levels.get(found.row, ())  # its std, this step's last
        jumped = len(levels) < 2 or levels[-1] - levels[-2] > found.moved / 2  # half its way out in this one point
        first = 0.0 if jumped else max(0.0, -min(asks))
        ask, waited = self.asked.get(found.row, (first, 0))
        if not pull < 0 and ((found.row not in self.asked and not ask > 0) or pull > ask):
            return False  # never asked for, or pushed back harder than it was asked (at this step): an overshoot
        # Asked at this step, or over its last points (one small batch's pull takes either sign).
        asked = pull < 0 or (math.isfinite(pull) and sum(recent) / len(recent) < 0)
        track = self._track(found.row)
        held = list(track.held) if track is not None else []
        before = held[:max(1, len(held) - 1 - waited)]  # up to the wait's start: a slow ramp adds up against it
        noise = track.noise if track is not None and math.isfinite(track.noise) else 0.0
        rising = len(held) < 2 or held[-1] > max(before) + max(MIN_NOISE["level"], noise)
        waited = 0 if rising else waited if asked else waited + 1  # the points since the loss stopped asking
        self.asked[found.row] = (max(ask, -pull), waited)
        if not rising and not asked and waited >= SETTLED:
            for track in self._output_tracks(found.row):  # at the level it reached, not with the growth as a trend
                settle_at(track, waited, self.bands.window)
        return asked or not rising

    def _slowed(self, found: Finding) -> bool:
        """Whether a module's outputs, out and not named yet, lean away from their range no faster than a creep.

        A row whose lean slowed under ``CREEP_PER_STEP`` a step over its last points (``lean_slowed``) is a
        layer's learning settling; a ramp keeps its pace. One named stays named while out; one counted as a
        victim stays counted while out (let go, its going further later would read as fresh).
        """
        if found.layer in self.named or found.row in self.affected or found.problem not in RELATIVE["level"]:
            return False
        return self._lean_slowed(found.row)

    def _lean_slowed(self, row: str) -> bool:
        """Whether a module's outputs (the track they are judged by) lean out no faster than a creep now.

        Shared by :meth:`_slowed` (not named) and ``_leaning`` (not named as the cause further up either).
        """
        track = self._track(row)
        return track is not None and lean_slowed(track, least_change(self._judged_by(row), self.bands))

    def _stacked(self, found: list[Finding]) -> list[Finding]:
        """The findings less the outputs that grew with their whole kind, or with their query-key partner.

        Their ranges follow the move, as they follow the row's own learning (``_peers.py``).
        """
        return self._followed(found, lambda f: f.figure in PEER_FIGURES and f.problem in RELATIVE["level"] and (
            self._grew_with_kind(f.row, f.moved > 0) or self._grew_with_partner(f.row, f.moved > 0)))

    def _unshared(self, figure: str, found: list[Finding]) -> list[Finding]:
        """The findings of a module's outputs, or of a gradient's norm, less the moves its same-kind peers made too.

        The peers are those before it in forward order (a gradient's: in backward order, ``_with_peers``). A move
        they share is the recipe: the row's range follows it, as it follows its own learning. The last copy of
        its kind ending a gradient over depth is excused (:meth:`_excused`: outputs only). A non-finite gradient
        is no move: never excused.
        """
        if figure not in SHARED_FIGURES:
            return found
        out = {f.row for f in found}
        moved = self._followed([f for f in found if f.problem in RELATIVE[figure]],
                               lambda f: self._shares_move(figure, f, out))
        kept = {id(f) for f in (self._excused(figure, moved, out) if figure in PEER_FIGURES else moved)}
        return [f for f in found if f.problem not in RELATIVE[figure] or id(f) in kept]

    def _shares_move(self, figure: str, found: Finding, out: Collection[str]) -> bool:
        """Whether a finding's move is its peers' (``_with_peers``); one not named yet is measured from its range too.

        A row leaning out slowly holds its range from before its window: its move within the window can be
        under the margin while it is out past it. Its move from its range (the finding's) is compared then.
        """
        beyond = None if found.layer in self.named else found.moved
        return self._with_peers(figure, found.row, found.moved > 0, out, beyond)

    def _followed(self, found: list[Finding], learned: Callable[[Finding], bool]) -> list[Finding]:
        """``found`` less the findings whose move is ``learned``: their rows' ranges follow the move instead."""
        kept = []
        for f in found:
            if learned(f):
                follow(self.tracks[f.figure][f.row], self.bands.window)
            else:
                kept.append(f)
        return kept
