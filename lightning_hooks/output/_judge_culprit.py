"""Which layer a judged step names: the culprit before its victims (host-side, torch-free).

A part of :class:`~lightning_hooks.output._judge.Judge` (docs/verdicts.md, "Culprit and victims"):

- The first module in forward order whose outputs are out (its inputs in range) is named; the
  modules after it, and other layers' gradients and ratios, are its victims. A ramp crosses its
  victims' ranges in any order: a module before it already leaning out the same way (and not
  moving with its same-kind peers) is named instead, unless the first left its range in one
  point (a step is not a ramp).
- The prediction layer that overshot (its pull above 0) far past the modules before it is named
  first (``_judge_pull.py``).
- Without an output finding: the last module in forward order whose output gradient went out
  (the first the backward pass reached), then the update ratio that moved most, then the
  gradient norm. Rows that moved alike (gradients gone to exactly 0 together, or non-finite
  together) are told apart as output gradients are: the last in forward order, the first the
  backward pass reached, is named (a zeroed or NaN output takes the gradients of what feeds it,
  before it, with it).
- While a named layer is still out, the others that go out are counted as affected, not named;
  a module before every named one that goes out is the cause further up, and is named.
- The first module in forward order moving out on its own is the batch (its input): ``data``; not where its own
  update ratio went out up at the step while its gradient norm did not (its learning rate), nor where its outputs
  are dead or non-finite (``its_own``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Mapping

from lightning_hooks.output._findings import BACKWARD, EVERY_LAYER, OUTPUT_PROBLEMS, RELATIVE, Finding, Judged
from lightning_hooks.output._health_bands import Bands
from lightning_hooks.output._judge_pull import overshot
from lightning_hooks.output._peers import Peers
from lightning_hooks.output._row_range import WARM_POINTS, Track, follow, in_warm_up, least_change

#: A module's outputs are judged by its gain where that is this many times quieter than its level: where the
#: module before it carries the batch-to-batch moves they share (an MLP's, a CNN's layers).
QUIETER = 1.5
#: A module before the first one out, leaning out the same way since the same point or one point later, led it where
#: it is 1/LEAN_SHARE as far out (log): a product of branches of one input moves with it, from the same point, as a
#: power of it (the Mamba mixer's ``out_proj``, ``y(x) * silu(z)``, 2.4 times its ``in_proj``'s move; 0.38 beyond
#: their ranges). One leaning since before (a layer learning), or later (a victim), must be half as far.
LEAN_SHARE = 3.0
#: A module that left its range by a step this many times as far (log) as every module before it out at the point,
#: all of them out from that point on, is named before them: a x20 step in one layer does not follow from a x1.3
#: move before it (a product of branches moves 2.4 times as far); logged every 20 steps, the layers before a
#: step learn in reaction to it before the next logged point (the MLP's: x1.3, where its culprit went x21).
DWARFS = 5.0


def its_own(layer: str, found: Collection[Finding]) -> bool:
    """Whether the first module's step out is its own fault, not its input's (the batch's), at the step.

    Its outputs dead (exact zeros) or non-finite are its own, as the judge says them of any module. Its own
    update ratio out up while its gradient norm is not is a step size per unit of gradient out: its param
    group's learning rate, which no batch moves (a batch x30 moves the gradient under SGD, and leaves Adam's
    update about as it was). The ratio out of its own range at the step, not one far above its peers' from the
    first step on (a param group's LR set high: no change at the step).
    """
    if any(f.row == layer and f.problem in ("dead", "nonfinite") for f in found):
        return True
    fast = {f.row for f in found if f.layer == layer and f.problem == RELATIVE["ratio"][0] and f.figure == "ratio"}
    return bool(fast - {f.row for f in found if f.layer == layer and f.problem == RELATIVE["norm"][0]})


class CulpritNaming:
    """How the judge names a step's culprit among its findings: mixed into :class:`~.output._judge.Judge`.

    It reads the judge's state, which the judge keeps (``_judge.py``).
    """

    bands: Bands
    depth: dict[str, int]  # each module's place in forward order
    tracks: dict[str, dict[str, Track]]  # by figure, by row: its range
    levels: Mapping[str, float]  # the step's activation std by module
    pulls: Mapping[str, float]  # the step's pull by module
    named: set[str]  # layers named and still out
    affected: set[str]  # rows out as victims
    excused: set[str]  # "figure/row": the last of its kind excused as the end of its kind's gradient
    peers: Peers
    gap: int  # the steps from the logged step before to this one
    _contained_in: tuple[tuple[int, int], frozenset[str]] = ((0, 0), frozenset())  # (the rows' dict, how many), blocks

    def _sort(self, found: list[Finding], data: bool) -> Judged:
        """Name the culprit, count the victims (see the module docstring)."""
        judged = Judged()
        self.affected &= {f.row for f in found}
        self.named &= {f.layer for f in found}  # a named layer still out keeps its name; the rest is what it did
        fresh = [f for f in found if f.row not in self.affected]
        stability = [f for f in fresh if f.figure not in RELATIVE]
        layered = [f for f in fresh if f not in stability]
        if self.named:  # ... unless a module before every named one goes out: the cause is further up
            top = min(self.depth.get(layer, 0) for layer in self.named)
            upstream = [f for f in layered if f.problem in OUTPUT_PROBLEMS and self.depth.get(f.layer, 0) < top]
            culprit = self._culprit(upstream) if upstream else None
            judged.named = [f for f in layered if f.layer in self.named or f.layer == culprit]
        elif layered and not data:
            culprit = self._culprit(layered)
            if culprit is not None and culprit == self._first() and self._left_by_a_step(culprit) and any(
                    f.layer == culprit and f.problem in RELATIVE["level"] for f in layered) and not its_own(
                    culprit, layered):
                data = True  # the first module's inputs are the batch (its outputs moved; dead or NaN is its own)
            elif culprit is not None:
                if all(f.layer != culprit for f in layered):  # leaning, not yet out: named for the move it leads
                    problem = next(f.problem for f in layered if f.problem in RELATIVE["level"])
                    track = self._track(culprit)
                    layered.append(Finding(culprit, culprit, problem, self.levels[culprit], "level",
                                           track.deviation if track is not None else 0.0))
                judged.named = [f for f in layered if f.layer == culprit]
        if data and not self.named:
            judged.named = [Finding(EVERY_LAYER, EVERY_LAYER, "data", len(found), "level")]
        judged.victims = [f for f in layered if f not in judged.named]
        judged.named = list({(f.row, f.problem): f for f in [*judged.named, *stability]}.values())
        self.named |= {f.layer for f in judged.named if f.layer != EVERY_LAYER}
        self.affected |= {f.row for f in judged.victims}
        return judged

    def _culprit(self, fresh: list[Finding]) -> str | None:
        outputs = [f for f in fresh if f.problem in OUTPUT_PROBLEMS]
        if outputs:
            first = min(outputs, key=lambda f: self.depth.get(f.layer, 0))
            return (overshot(outputs, self._last(), self.pulls) or self._leaning(first) or self._dwarfing(outputs)
                    or first.layer)
        backward = [f for f in fresh if f.figure == BACKWARD]
        if backward:  # the first module the backward pass reached whose output gradient went out
            return max(backward, key=lambda f: self.depth.get(f.layer, 0)).layer
        for figure in ("ratio", "norm"):
            rows = [f for f in fresh if f.figure == figure]
            if rows:  # a tie (gradients gone to 0 together, or non-finite): the first the backward pass reached
                return max(rows, key=lambda f: (abs(f.moved), self.depth.get(f.layer, 0))).layer
        return None

    def _first(self) -> str | None:
        """The first module in forward order whose outputs are judged."""
        return min(self.levels, key=lambda row: self.depth.get(row, 0)) if self.levels else None

    def _last(self) -> str | None:
        """The last module in forward order whose outputs are judged at the step (the loss's side), or None."""
        return max(self.levels, key=lambda row: self.depth.get(row, 0)) if self.levels else None

    def _leaning(self, first: Finding) -> str | None:
        """The first module before ``first`` already leaning out the same way, or None.

        A ramp crosses its victims' ranges in any order, its own not always first. A step is not a
        ramp: where ``first`` left its range in one point (it held no value out before), it is named.
        """
        own = self._track(first.row)
        if first.problem not in RELATIVE["level"] or (own is not None and len(own.held) <= 1):
            return None
        up, held = first.problem == RELATIVE["level"][0], len(own.held) if own is not None else 0
        # Half the way out already, and half as far as ``first``: the same move, not a drift of its own. A third
        # where it left its range with ``first`` or one point after (``LEAN_SHARE``): a product of branches of one
        # input (later: a victim leaning out after the culprit, under SGD).
        floor = math.log(self.bands.level_factor) / 2
        least = {True: max(floor, abs(first.moved) / LEAN_SHARE), False: max(floor, abs(first.moved) / 2)}
        depth = self.depth.get(first.layer, 0)
        tracks = {row: self._track(row) for row in self.levels if self.depth.get(row, 0) < depth}
        leaning = [row for row, t in tracks.items() if t is not None and not self._learning_with_peers(row, up)
                   and (t.deviation if up else -t.deviation) > least[held - 1 <= len(t.held) <= held]
                   and (t.up if up else t.down) and not self._lean_slowed(row)]
        return min(leaning, key=lambda row: self.depth.get(row, 0)) if leaning else None

    def _dwarfing(self, outputs: list[Finding]) -> str | None:
        """The first module whose outputs left their range by a step ``DWARFS`` times as far as every one before it.

        Only where every module out left its range at this point (none held a value out before), up or down by a
        finite move: a step, the moves before it its reaction. A step is the value held out against the last let
        in, as ``_left_by_a_step`` reads it (a quiet row just past a narrow range has made none). A module before
        it leaning out already is ``_leaning``'s; dead or non-finite outputs are named in forward order; the
        prediction layer's step is its pull's to judge (``overshot``).
        """
        steps = {}  # each one's step (not how far past its range), where it left its range at this point
        for f in outputs:
            track = self._track(f.row)
            step = self._step_out(track)
            if f.problem in RELATIVE["level"] and track is not None and len(track.held) == 1 and step is not None:
                steps[f.row] = step
        fresh = [f for f in outputs if math.isfinite(steps.get(f.row, math.nan))]
        if len(fresh) < len(outputs) or len(fresh) < 2:
            return None
        fresh.sort(key=lambda f: self.depth.get(f.layer, 0))
        for i, big in enumerate(fresh[1:], 1):  # the first so far past every one before it
            if all(steps[big.row] >= DWARFS * steps[f.row] for f in fresh[:i]):
                if big.row == self._last() or not self._left_by_a_step(big.row):  # the prediction layer: ``overshot``
                    return None
                return big.layer
        return None

    def _left_by_a_step(self, row: str) -> bool:
        """Whether a module's outputs left their range by a step (past the factor from the value before).

        Their first value held out moved past the figure's factor from the value let in before it. A
        batch out of range is a step (every layer at once, from one batch on); the first module
        ramping out over several points is its own fault, named as any module's.
        """
        step = self._step_out(self._track(row))
        return step is None or step > least_change(self._judged_by(row), self.bands)

    @staticmethod
    def _step_out(track: Track | None) -> float | None:
        """How far (log) a row's first value held out moved from the value let in before it; None if it holds none."""
        if track is None or not track.held or not track.logs:
            return None
        return abs(track.held[0] - track.logs[-1])

    def _track(self, row: str) -> Track | None:
        """The track a module's outputs are judged by: its gain's if that is quieter than its level's.

        A block watched whole beside the modules inside it is judged by its gain (what it adds to the
        residual stream it is handed): its level is the stream's, which grows with every block before it.
        """
        level, gain = self.tracks.get("level", {}).get(row), self.tracks.get("gain", {}).get(row)
        if gain is not None and row in self._containers():
            return gain
        return gain if gain is not None and level is not None and gain.noise * QUIETER < level.noise else level

    def _inward(self, found: Finding, out: Collection[str]) -> Finding:
        """A block out while no module inside it is (of ``out``): the inner module that moved with it, if one did.

        A layer ramping from the warm-up on is taken in as its own trend, never out of its range; its block's
        gain, judged as a level, goes out for it. The block's finding is the layer's then: the module inside
        whose figure (gain or level, as it is judged) moved furthest the block's way over its window
        (``_peers.py``), in least changes, where that is past one least change and at least half as far as
        the block's gain moved (the stream a block is handed dilutes what a layer inside adds to it: the
        layer moves further), traced back through the modules before it in forward order, inside the block, that
        moved with it (``_fed``): a gated MLP's ``down_proj`` moves twice as far as a ramp in the norm before it.
        A block's own fault (its whole output scaled) moves no module inside it, and stays the block's. Whichever
        is named, the block or a layer inside it, stays named while the block is out, a victim inside it out too.
        """
        if found.row not in self._containers() or found.problem not in RELATIVE["level"] or found.row in self.named:
            return found  # not a block's outputs, or named as itself: it stays the block's while it is out
        inward = sorted(row for row in self.named if row.startswith(found.row + "."))
        if inward:  # named for a layer inside it: that layer's while the block is out (a victim inside out too)
            return Finding(inward[0], inward[0], found.problem, self.levels.get(inward[0], found.value), "level",
                           found.moved)
        if any(row.startswith(found.row + ".") for row in out):
            return found
        own = self._peers_for(found.row, "gain").move("gain", found.row)
        sign = 1 if found.moved > 0 else -1
        inner = []  # each module inside: its move in its figure's least changes, its move, its name
        for row in self.levels:
            if row.startswith(found.row + "."):
                figure = self._judged_by(row)
                move = self._peers_for(row, figure).move(figure, row)
                if move is not None:
                    inner.append((sign * move / least_change(figure, self.bands), move, row))
        if own is None or not inner:
            return found
        changes, move, row = max(inner)  # its move in its figure's least changes: past one, and the block's half
        if changes < 1 or sign * move < sign * own / 2:
            return found
        before, furthest = self._before(), move
        while (fed := before.get(row, "")).startswith(found.row + "."):
            if (by := self._fed(fed, furthest)) is None:
                break
            row, move = fed, by  # the module before it, inside the block, moved with it: it is that one's victim
        return Finding(row, row, found.problem, self.levels[row], "level", move)

    def _fed(self, row: str, moved: float) -> float | None:
        """A module's outputs' move over its window (``_peers.py``) where it moved with the furthest mover, else None.

        That is: the same way as ``moved`` (the furthest mover's), past one least change, and at least
        1/``LEAN_SHARE`` as far (a product of two projections of one input moves twice as far as the input).
        """
        move = self._peers_for(row, "level").move("level", row)
        sign = 1 if moved > 0 else -1
        least = self._margin("level", sign > 0)
        return move if move is not None and sign * move > max(least, sign * moved / LEAN_SHARE) else None

    def _containers(self) -> frozenset[str]:
        """The modules watched beside two or more modules inside them: blocks of a stack.

        A layer with one module inside it (transformers' fused MoE experts beside their ``act_fn``) is a layer.
        """
        levels = self.tracks.get("level", {})
        key = (id(levels), len(levels))  # rows are only added (a restored judge has a new dict)
        if key != self._contained_in[0]:
            ordered = sorted(levels)

            def holds(row: str) -> bool:  # the names inside ``row`` sort from ``row.`` to ``row/``
                return bisect.bisect_left(ordered, row + "/") - bisect.bisect_left(ordered, row + ".") >= 2

            self._contained_in = (key, frozenset(filter(holds, ordered)))
        return self._contained_in[1]

    def _judged_by(self, row: str) -> str:
        """The figure a module's outputs are judged by (:meth:`_track`): ``"gain"`` or ``"level"``."""
        return "gain" if self._track(row) is self.tracks.get("gain", {}).get(row) else "level"

    def _learning_with_peers(self, row: str, up: bool) -> bool:
        """Whether a module's outputs lean the way its same-kind peers, or its query-key partner, moved too."""
        figure = self._judged_by(row)
        return (self._with_peers(figure, row, up) or self._ends_gradient(figure, row, up)
                or self._grew_with_kind(row, up) or self._grew_with_partner(row, up))

    def _with_peers(self, figure: str, row: str, up: bool, out: Collection[str] = (),
                    beyond: float | None = None) -> bool:
        """Whether ``row``'s move of ``figure`` (up or down) is one its same-kind peers made too (``_peers.py``).

        Those before it; for a module judged by its std, also its gain's move where the next copy's gain made it
        (``Peers.gain_alike_after``). ``beyond``: how far it is out of its range, its move where its window's is
        under the margin (a slow lean).
        """
        margin = self._margin(figure, up)
        leaning = {other for other, track in self.tracks.get(figure, {}).items() if track.up or track.down}
        peers, depth = self._peers_for(row, figure), self.depth
        if figure == "norm":  # a parameter's gradient: its module's place in the backward pass (forward, reversed)
            depth = {other: -self.depth.get(self.layer(figure, other), 0) for other in peers.history.get(figure, {})}
        return peers.shared(figure, row, depth, margin, up, out, leaning, beyond) or (
            figure == "level" and self._judged_by(row) == "level"
            and peers.gain_alike_after(row, depth, (margin, self._margin("gain", up)), up, out))

    def _excused(self, figure: str, found: list[Finding], out: Collection[str]) -> list[Finding]:
        """``found`` less the last copies of their kind that end a gradient over depth (``_peers.py``).

        Excused, not learned: no copy after it vouches for its move, so its range is held while its
        predecessor moves, and follows the move only once it stopped too (its own move within the
        margin again). One that goes on after its predecessor stopped (a ramp) is named then. One
        named (a step, or a ramp) stays named while out: its move is its own, not its predecessor's.
        """
        kept = []
        for f in found:
            key, up = f"{figure}/{f.row}", f.moved > 0
            if f.layer in self.named:
                kept.append(f)
            elif self._ends_gradient(figure, f.row, up, out):
                self.excused.add(key)
            elif key in self.excused and self._stopped(figure, f.row, up):
                follow(self.tracks[figure][f.row], self.bands.window)  # it stopped with its predecessor: learning
            else:
                kept.append(f)
        # back in range, or named: no longer excused
        excused = {f.row for f in found} - {f.row for f in kept}
        self.excused -= {f"{figure}/{row}" for row in self.tracks.get(figure, {}) if row not in excused}
        return kept

    def _stopped(self, figure: str, row: str, up: bool) -> bool:
        """Whether a row's own move is within the margin of a finding again (``up`` or down)."""
        move = self._peers_for(row, figure).move(figure, row)
        return move is not None and (1 if up else -1) * move <= self._margin(figure, up)

    def _ends_gradient(self, figure: str, row: str, up: bool, out: Collection[str] = ()) -> bool:
        """Whether ``row``, the last copy of its kind, ends its kind's gradient over depth (``_peers.py``)."""
        return self._peers_for(row, figure).ends_gradient(figure, row, self.depth, self._margin(figure, up),
                                                          up, out)

    def _grew_with_kind(self, row: str, up: bool) -> bool:
        """Whether a module's kind grew as a whole, as far as a finding, its gain leading none (``_peers.py``).

        A network without normalisation under SGD grows everywhere at once: every copy is out of its
        range together, and the peers rule has none in range to compare with.
        """
        return self._peers_for(row).grew_as_a_kind(row, self._margin("level", up), self._margin("gain", up), up)

    def _grew_with_partner(self, row: str, up: bool) -> bool:
        """Whether a query or key projection moved with its partner: attention sharpening (``_peers.py``)."""
        return self._peers_for(row).grew_with_partner(row, self._margin("level", up), up, self.gap)

    def _margin(self, figure: str, up: bool) -> float:
        """The least move (log) of ``figure`` that is a finding: upward one least change, downward twice as far."""
        return least_change(figure, self.bands) * (1 if up else 2)

    def _peers_for(self, row: str, figure: str | None = None) -> Peers:
        """The peers, the fewest values a move needs set for judging ``row`` (its ``figure``'s track, or ``_track``).

        ``WARM_POINTS`` while ``row`` is in its own warm-up (``in_warm_up``: a warm-up step's peers judge it as
        they do later); as many as its own range holds after (at most ``min_points``): a peer that started late (an
        expert first routed late) does not count with a few values.
        """
        track = self._track(row) if figure is None else self.tracks.get(figure, {}).get(row)
        warm = track is None or in_warm_up(track, self.bands)
        self.peers.least = WARM_POINTS if warm else min(self.bands.min_points, len(track.logs))
        return self.peers
