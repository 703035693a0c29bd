"""A module against its peers of the same kind before it: a move they all made is the recipe, not a fault.

Host-side and torch-free, a part of :mod:`lightning_hooks.output._judge` (docs/verdicts.md). Two
modules are of the same kind where their names differ only in their numbered parts
(``encoder.layer.2.attention.self.key`` and ``encoder.layer.0.attention.self.key``; ``model.4`` and
``model.2``). A healthy recipe can move every module of a kind together (a BERT's attention keys
and queries grow 3x as its attention sharpens, in every block); a fault in one module cannot move
its peers *before* it in forward order (their inputs do not pass through it). So a module whose
outputs left their range is not named where its peers before it made at least half its move, over
its last ``window`` logged values, and it is within the figure's factor of theirs (the nearest
one's, or their median's): it learned with them. Learning can grow with depth past that factor (each
block's outputs growing more than the block's before): where the peer just before it moved past the
factor itself, at least half as far, the module kept its pace (at most ``DEPTH_PACE_RATIO`` times as
fast over their newest points), and a copy after it moved on at least ``DEPTH_CARRIED`` as far, it
learned with them too; a ramp outpaces them, and a fault in a normalised block leaves the copies after
it in place (outputs only, never the first of a kind). Only peers in their own range count: a move a
peer made out of its range is a fault's, and what follows it its victim. A gradient's norm is compared
with its peers the same way, in backward order (the judge gives the depths). The first module of its
kind, with no peer before it, is compared with the copies after it, in their own range: a fault
there that moved them made them victims, out of their range too. A module with no move of its own
past the factor within its window (a jump its window has forgotten) is never excused: it stays out.
A module whose move lies between its neighbours' is learning too: the peer before it moved the same
way, and the peer after it, steady in its own range, at least as far (an MLP-Mixer's token-mixing
layers each grow more than the block's before: a gradient over depth, not one block's fault, which
cannot move a later copy as far while leaving it in its range). A kind can learn at rates a little apart: a
module whose copies just before and after it, in their own range, each made ``NEIGHBOURS_SHARE`` of its move, at a
pace it kept, learned with them (not a Sequential's children, whose victim after a fault moves as far). A gain is
learning too where the next copy
after it (in its own range) moved its own gain the same way at least half as far: a fault moves its own gain,
not the gains after it (their inputs carry its move); a module judged by its std likewise, where its gain's move is
such (its std's move is its input's and its gain's), but not a step in its std. The last copy of its kind (a block's
named part, not a Sequential's child), with no peer after it, ends such a gradient where the peer
before it moved the same way past half the margin (more than its noise) and it at most ``STEEPEST``
times as far, and its newest point alone did not move past the margin: a fault in the last block
moves it alone (its predecessor in place), and a step is its own.
Excused, not learned (the judge holds its range until it stops: ``_judge_culprit.py``).
The other way round, a copy far ahead of every other copy of its kind (``OUTPACE``) is out even where its own
range took its move in as its trend (``Peers.outpaced``).
"""

from __future__ import annotations

import functools
import math
import re
import statistics
from collections import deque
from collections.abc import Collection, Mapping
from typing import Any

#: The figures of a module's outputs, judged against their same-kind peers before them (a gradient's norm is
#: judged against its peers in backward order, where the copies after it are its victims: no learning over depth).
PEER_FIGURES = ("level", "gain")
#: A numbered part of a module's name (a block's or a Sequential's index).
_NUMBER = re.compile(r"(^|\.)\d+(?=\.|$)")
#: The last copy of a kind ends a gradient over depth where it moved at most this many times the copy before it
#: (the Mixer's last token-mixing layer x2.7 its predecessor's move, the pre-activation ResNet's last conv x2.3).
STEEPEST = 3.0
#: A module keeps its learning peer's pace where its move over its newest this many points is at most
#: ``DEPTH_PACE_RATIO`` times the peer's, the same way: learning that grows with depth, not a ramp, which
#: outpaces the layers learning beside it (a BERT's attention output projections over steps 85-130: x1.7,
#: x1.8, x2.5 in blocks 2-4; a pre-activation ResNet's block inputs x1.3, x1.7, x2.4 over 48 steps, at
#: paces 2.0-2.2 times the block before's).
DEPTH_PACE_POINTS = 8
DEPTH_PACE_RATIO = 2.5
#: ... and a copy after it moved the same way at least this share of its move (the BERT's block 5: 0.9 of block 4's).
DEPTH_CARRIED = 0.8
#: ... or where the copies just before and just after it each moved the same way at least this share of its move, at
#: a pace no more than ``DEPTH_PACE_RATIO`` times the faster's: a kind learning at rates a little apart (a healthy
#: RoBERTa's attention outputs: block 4 1.35, blocks 3 and 5 0.78 and 0.98; at twice its LR, logged every step, one
#: batch's point takes block 4 to 1.07 against 0.57 and 0.87: 0.54 of it, where 0.55 named it for 3 steps).
NEIGHBOURS_SHARE = 0.5
#: A module whose outputs moved this many margins (x2.44 up at ``level_factor`` 1.25) over its window, and as far
#: ahead of every copy of its kind, is out, whatever its own range says (``Peers.outpaced``): a ramp begun in the
#: judge's warm-up rides its row's trend (a BART encoder's last attention output x25 over 110 steps, its two copies
#: steady). Over every recorded healthy run a kind's fastest copy stayed within it, but for a pre-activation ResNet's
#: last block (x2 its predecessor's move: ``STEEPEST``).
OUTPACE = 4.0
#: ... judged from this many logged values on (a window's older half of 4 against its newest values) ...
OUTPACE_POINTS = 8
#: ... its move from the median of its newest this many values: one batch is no move.
RECENT_POINTS = 3


def next_gain_alike(after: list[float], mine: float, sign: int, margin: float) -> bool:
    """Whether the next copy's own gain (the first of ``after``) moved ``mine``'s way, half as far, within ``margin``.

    A fault moves its own gain, not the gains after it (their inputs carry its move); one that goes on past the
    next copy's learning by more than the margin is its own again.
    """
    return bool(after) and sign * after[0] >= sign * mine / 2 and sign * (mine - after[0]) <= margin


#: The projections one attention makes of the same input, (query, key, value), by the names models give them:
#: siblings, not one the input of the next, though forward order runs them one after the other.
PROJECTIONS = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"), ("q", "k", "v"), ("to_q", "to_k", "to_v"),
               ("wq", "wk", "wv"), ("q_lin", "k_lin", "v_lin"))
#: The query and key projections of one attention (of :data:`PROJECTIONS`): their product is the attention
#: logits, and attention sharpening as it learns grows both together (ALBERT's one shared layer: x4 each over
#: steps 20-160, with no copies to grow beside). A fault moves one of them alone.
PARTNERS = {query: key for query, key, _ in PROJECTIONS}
PARTNERS.update({key: query for query, key in list(PARTNERS.items())})
#: Past this pace (log a step, over a pair's newest ``PARTNER_POINTS`` points) queries and keys growing together are
#: not learning: attention logits running away (an LR too high for attention) are a fault. ALBERT's sharpening
#: went 1.9% a step at its fastest.
PARTNER_PACE = math.log(1.03)
PARTNER_POINTS = 4


def siblings(row: str, other: str) -> bool:
    """Whether ``row`` and ``other`` are two projections of one attention's input (``self.query``, ``self.key``)."""
    parent, _, last = row.rpartition(".")
    other_parent, _, other_last = other.rpartition(".")
    return parent == other_parent and last != other_last and any(last in s and other_last in s for s in PROJECTIONS)


def partner(row: str) -> str | None:
    """The other of a query and key projection pair (``attention.query`` -> ``attention.key``), or None."""
    parent, _, last = row.rpartition(".")
    other = PARTNERS.get(last)
    return None if other is None else f"{parent}.{other}" if parent else other


@functools.lru_cache(maxsize=1 << 16)  # every rule asks it of every row at every logged step (10 µs a call)
def kind(row: str) -> str:
    """A module's name with its numbered parts replaced by ``#``: the same for every block's copy of it."""
    return _NUMBER.sub(r"\1#", row)


class Peers:
    """Each module's recent values of a figure (log), to compare its move with its peers'.

    Args:
        window: How many logged values each row keeps.
        least: The fewest values a row needs before its move counts (the judge sets it per judged row).
    """

    def __init__(self, window: int, least: int) -> None:
        self.window, self.least = window, least
        self.history: dict[str, dict[str, deque[float]]] = {}

    def add(self, figure: str, logs: Mapping[str, float]) -> None:
        """Keep one step's finite log values of ``figure``."""
        rows = self.history.setdefault(figure, {})
        for row, x in logs.items():
            if math.isfinite(x):
                rows.setdefault(row, deque(maxlen=self.window)).append(x)

    def move(self, figure: str, row: str) -> float | None:
        """The row's newest value minus the median of the older half of its window (log), or None."""
        values = self.history.get(figure, {}).get(row)
        if values is None or len(values) < self.least:
            return None
        return values[-1] - statistics.median(list(values)[:len(values) // 2])

    def shared(self, figure: str, row: str, depth: Mapping[str, int], margin: float, up: bool,
               out: Collection[str], leaning: Collection[str] = (), beyond: float | None = None) -> bool:
        """Whether ``row``'s move (``up`` or down) is its peers': half of it theirs, and at most ``margin`` past.

        Its peers' move: the nearest one's before it (the block before's copy, the likest) or their
        median's, of the peers in their own range (not in ``out``): a move a peer made out of its
        range is a fault's, and what follows it is its victim, not the recipe. With no peer before
        it, the copies after it. Outputs only: a move past its nearest peer's by more than ``margin`` is learning too
        where the copies just before and just after it each made at least ``NEIGHBOURS_SHARE`` of it at a pace it
        kept (``_neighbours_learned``), or the peer before moved past the margin, at least half as far, the row kept
        its pace and a copy after it carried on (``DEPTH_CARRIED``). ``beyond``: how far
        the row is out of its range (its finding's move), its move where its window's is under the ``margin`` (a
        range held since before the window: a slow lean).
        """
        mine = self._own_move(figure, row, margin, up)
        if mine is None and beyond is not None and (1 if up else -1) * beyond > margin:
            mine = beyond  # out past the margin from a range older than its window: it moved that far
        if mine is None:
            return False
        sign, at = 1 if up else -1, depth.get(row, 0)
        peers = self._peers(figure, row, depth, out)
        below, above = [p for p in peers if p[0] < at], [p for p in peers if p[0] > at]
        before, after = [m for _, m, _ in below], [m for _, m, _ in above]
        nearest = below[-1:] or above[:1]  # the peer just before it; for the first of its kind, the copy after it
        if not nearest:
            return False
        near, near_row = nearest[0][1:]
        if figure == "gain" and next_gain_alike(after, mine, sign, margin):
            return True
        typical = statistics.median(before or after)
        # theirs at least half of its move, and its own part within the margin
        if any(sign * m >= sign * mine / 2 and sign * (mine - m) <= margin for m in (near, typical)):
            return True
        if figure in PEER_FIGURES and below and above and self._neighbours_learned(figure, row, below[-1], above[0],
                                                                                    mine, sign):
            return True
        # outputs: the peer before learning past the margin itself, at least half as far, its pace kept, a copy
        # after moving on: learning over depth (not for the first of its kind, whose copies after are its victims)
        if figure in PEER_FIGURES and before and sign * near > margin and sign * near >= sign * mine / 2 \
                and self._keeps_pace(figure, row, near_row, sign) and self._carried_on(figure, row, depth, mine, sign):
            return True
        # between its neighbours: the one before moved the same way, the one after (steady) at least as far
        steady = [m for d, m, other in peers if d > at and other not in leaning]
        return bool(before and steady) and sign * before[-1] > 0 and sign * steady[0] >= sign * mine

    def gain_alike_after(self, row: str, depth: Mapping[str, int], margins: tuple[float, float], up: bool,
                         out: Collection[str] = ()) -> bool:
        """Whether ``row``'s gain moved past its margin as the next copy after it (in its own range) moved its own.

        For a module judged by its std: its move is its input's (the layers before it) and its gain's, and a gain's
        move the next copy made too is its kind's learning (:func:`next_gain_alike`), not a fault in it. Not where
        its std's newest point alone moved past its margin: a step is its own (its gain's point may not be in yet).
        ``margins``: the std's and the gain's.
        """
        mine, sign = self._own_move("gain", row, margins[1], up), 1 if up else -1
        if mine is None or self._stepped("level", row, sign, margins[0]):
            return False
        at = depth.get(row, 0)
        after = [m for d, m, _ in self._peers("gain", row, depth, out) if d > at]
        return next_gain_alike(after, mine, sign, margins[1])

    def ends_gradient(self, figure: str, row: str, depth: Mapping[str, int], margin: float, up: bool,
                      out: Collection[str]) -> bool:
        """Whether ``row``, the last copy of its kind, ends a gradient over depth (see the module docstring).

        No copy after it bounds its move, so the one before (in its own range) does: it moved the same
        way past half the ``margin`` (more than its noise), and ``row`` at most ``STEEPEST`` times as
        far. Not where its newest point alone moved past the ``margin``: a step is its own (a fault).
        Only a block's named part (``blocks.3.mix``): a Sequential's children (``net.2``, ``mlp.2``) are
        of one kind by name but not by type (the head after its activation), no gradient over depth.
        """
        mine = self._own_move(figure, row, margin, up)
        at, own = depth.get(row, 0), kind(row)
        if mine is None or own.endswith("#") or any(depth.get(other, 0) > at for other in self.history[figure]
                               if other != row and kind(other) == own):
            return False
        sign = 1 if up else -1
        before = [m for d, m, _ in self._peers(figure, row, depth, out) if d < at]
        return bool(before) and sign * before[-1] >= margin / 2 and sign * mine <= STEEPEST * sign * before[-1] \
            and not self._stepped(figure, row, sign, margin)

    def _stepped(self, figure: str, row: str, sign: int, margin: float) -> bool:
        """Whether the row's newest point alone moved past ``margin`` (``sign``'s way), or it has no two points.

        A step is its own (a fault), never a peer's learning.
        """
        values = self.history.get(figure, {}).get(row, ())
        return len(values) < 2 or sign * (values[-1] - values[-2]) > margin

    def _neighbours_learned(self, figure: str, row: str, before: tuple[int, float, str], after: tuple[int, float, str],
                            mine: float, sign: int) -> bool:
        """Whether the copies just ``before`` and just ``after`` ``row`` each made ``NEIGHBOURS_SHARE`` of its move.

        A kind learning at rates a little apart (outputs only). Not a Sequential's children (``model.#``: one kind by
        name, not by type, a fault's victim after it moving as far), and not where ``row`` moved faster than
        ``DEPTH_PACE_RATIO`` times the faster of the two over their newest points: a ramp outpaces the layers
        learning beside it. ``before`` and ``after``: (depth, move, name), in their own range.
        """
        if kind(row).endswith("#") or min(sign * before[1], sign * after[1]) < NEIGHBOURS_SHARE * sign * mine:
            return False
        return any(self._keeps_pace(figure, row, peer, sign) for _, _, peer in (before, after))

    def _keeps_pace(self, figure: str, row: str, peer: str, sign: int) -> bool:
        """Whether ``row`` moved at most ``DEPTH_PACE_RATIO`` times as fast as ``peer`` over their newest points.

        Both the same way (``sign``): a ramp outpaces a layer learning beside it, whatever their moves over the window.
        """
        mine, theirs = self.pace(figure, row, DEPTH_PACE_POINTS), self.pace(figure, peer, DEPTH_PACE_POINTS)
        return (mine is not None and theirs is not None and sign * theirs > 0
                and sign * mine <= DEPTH_PACE_RATIO * sign * theirs)

    def _carried_on(self, figure: str, row: str, depth: Mapping[str, int], mine: float, sign: int) -> bool:
        """Whether a copy after ``row``, in its range or not, moved the same way ``DEPTH_CARRIED`` of ``mine`` or more.

        Learning that grows with depth goes on growing after it; a fault in a normalised block leaves the copies after
        it where they were, and the last copy of its kind has none (``ends_gradient`` judges it).
        """
        at = depth.get(row, 0)
        return any(d > at and sign * m >= DEPTH_CARRIED * sign * mine
                   for d, m, _ in self._peers(figure, row, depth, ()))

    def _own_move(self, figure: str, row: str, margin: float, up: bool) -> float | None:
        """The row's move, where it moved past ``margin`` the way it is out (``up`` or down), else None.

        None too where it has no such move in its window: it is still out since a step, and named.
        """
        mine = self.move(figure, row)
        return mine if mine is not None and (1 if up else -1) * mine > margin else None

    def _peers(self, figure: str, row: str, depth: Mapping[str, int],
               out: Collection[str]) -> list[tuple[int, float, str]]:
        """``row``'s same-kind peers in their own range (not in ``out``) with a move: (depth, move, name), in order."""
        return sorted((depth.get(other, 0), m, other) for other in self.history.get(figure, {})
                      if other not in out and other != row and kind(other) == kind(row)
                      and (m := self.move(figure, other)) is not None)

    def grew_as_a_kind(self, row: str, least: float, margin: float, up: bool) -> bool:
        """Whether ``row``'s kind grew as a whole (``up`` or down), its gain leading none of its copies'.

        Every copy's outputs moved at least ``least`` that way over its window (a fault in one module
        cannot move the copies before it), and ``row``'s gain moved at most ``margin`` past the furthest
        of theirs (a fault moves its own gain, not its copies'). False with fewer than two copies, or
        where one has too little history.
        """
        sign = 1 if up else -1
        copies = [other for other in self.history.get("level", {}) if other != row and kind(other) == kind(row)]
        levels = [self.move("level", other) for other in copies]
        gains = [self.move("gain", other) for other in (row, *copies)]
        if len(copies) < 2 or None in levels or None in gains:
            return False
        return all(sign * m >= least for m in levels) and sign * gains[0] - max(sign * m for m in gains[1:]) <= margin

    def pace(self, figure: str, row: str, points: int) -> float | None:
        """The row's move (log) over its newest ``points`` points, a point; None with fewer values."""
        values = self.history.get(figure, {}).get(row)
        if values is None or len(values) <= points:
            return None
        return (values[-1] - values[-1 - points]) / points

    def grew_with_partner(self, row: str, margin: float, up: bool, gap: int = 1) -> bool:
        """Whether ``row``'s query-key partner (:func:`partner`) moved its outputs the same way with it.

        Over their windows the partner moved that way at least half as far as ``row`` did, and within ``margin``
        of it, each no faster than ``PARTNER_PACE`` a step over its newest points (``gap`` steps a point): the
        attention sharpening (or flattening), not a fault in one of them, nor logits running away.
        """
        other = partner(row)
        mine, theirs = self.move("level", row), self.move("level", other) if other is not None else None
        if mine is None or theirs is None:
            return False
        sign = 1 if up else -1
        if not (sign * mine > 0 and sign * theirs >= sign * mine / 2 and abs(mine - theirs) <= margin):
            return False
        paces = [self.pace("level", name, PARTNER_POINTS) for name in (row, other)]
        return all(p is not None and abs(p) <= PARTNER_PACE * gap for p in paces)

    def outpaced(self, figure: str, margin: float,
                 leads: Mapping[str, tuple[float, float, float]] | None = None) -> dict[str, float]:
        """The rows that moved ``OUTPACE`` margins and as far ahead of every copy of their kind: how far ahead (log).

        Their moves and leads as :meth:`leads` measures them; a move down needs twice as far, and the row must have
        moved ``STEEPEST`` times as far as each copy that moved its way: a kind's gradient over depth moves its last
        copy 2-3 times its predecessor's. A ramp begun where its row's own range cannot see it (in the warm-up, or
        over a range the warm-up's swings widened) takes it there; a kind's fastest learner of any recorded healthy
        run stayed within it. ``leads``: :meth:`leads`'s, where the caller has them.
        """
        ahead = {}
        for row, (mine, lead, furthest) in (self.leads(figure) if leads is None else leads).items():
            sign = 1 if mine > 0 else -1
            need = OUTPACE * margin * (1 if sign > 0 else 2)
            if sign * mine >= need and sign * lead >= need and sign * mine >= STEEPEST * furthest:
                ahead[row] = lead
        return ahead

    def leads(self, figure: str) -> dict[str, tuple[float, float, float]]:
        """Each row's move, its lead over the copies of its kind, and the furthest a copy moved its way (log).

        A row's move: its ``RECENT_POINTS`` newest values' median against its window's older half's (one batch is
        no move), from ``OUTPACE_POINTS`` values on. Its lead: how far beyond every copy's move it is, the way it
        moved (signed as its move; negative where a copy moved further). Only a block's named part
        (``blocks.3.attn.out_proj``; a Sequential's children are one kind by name, not by type) with three copies
        or more.
        """
        kinds: dict[str, list[tuple[float, str]]] = {}
        for row, values in self.history.get(figure, {}).items():
            own = kind(row)
            if len(values) >= OUTPACE_POINTS and not own.endswith("#"):
                logs = list(values)
                move = statistics.median(logs[-RECENT_POINTS:]) - statistics.median(logs[:len(logs) // 2])
                kinds.setdefault(own, []).append((move, row))
        leads = {}
        for copies in kinds.values():
            if len(copies) < 3:
                continue
            ranked = sorted(copies)  # the two lowest and the two highest: each row's furthest other copy either way
            for mine, row in copies:
                highest = ranked[-2][0] if ranked[-1][1] == row else ranked[-1][0]
                lowest = ranked[1][0] if ranked[0][1] == row else ranked[0][0]
                if mine > 0:
                    leads[row] = (mine, mine - highest, max(0.0, highest))
                else:
                    leads[row] = (mine, mine - lowest, max(0.0, -lowest))
        return leads

    def state_dict(self) -> dict[str, Any]:
        """The kept values, as plain lists."""
        return {figure: {row: list(v) for row, v in rows.items()} for figure, rows in self.history.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.history = {figure: {row: deque(v, maxlen=self.window) for row, v in rows.items()}
                        for figure, rows in state.items()}
