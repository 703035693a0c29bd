"""How the judge reads a module's gain: its std over the std of the module before it (host-side, torch-free).

A part of :class:`~lightning_hooks.output._judge.Judge` (docs/verdicts.md): a module's outputs are
judged by their gain where that is the quieter figure. A gain's finding stands where the module's own
std moved the same way (``AGREE``), or where its input's std leaned out only after the gain had
(``LEAD``): the gain led. A module judged by its gain whose level moved while its gain held has its
level's range follow the move (its input's). An attention's key and value projections take their input's std
from the module before the query: the projections are siblings, not one the input of the next (``siblings``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection

from lightning_hooks.output._findings import Finding
from lightning_hooks.output._peers import siblings
from lightning_hooks.output._row_range import follow, least_change

#: A gain's finding stands where the module's own outputs moved the same way, this share of the gain's move at least.
AGREE = 0.5
#: A gain leads its input's fall where the input leaned out 1 to this many logged points after the gain did.
LEAD = 4


class GainJudging:
    """The gain's rules, mixed into :class:`~lightning_hooks.output._judge.Judge`, whose state they read."""

    _containers: Callable[[], frozenset[str]]  # the blocks of a stack among the rows (``_judge_culprit.py``)

    def _follow_input(self, dropped: list[Finding], gains: list[Finding]) -> None:
        """Let the level's range follow a move of a module judged by its gain where its gain held none of it.

        Its gain in range (no finding, nothing held back) says the move is its input's: the level learned
        it, as a move its peers excuse does (``follow``), and holds no stale finding should the module be
        judged by its level later (its gain's noise jumping for a point).
        """
        moved = {f.row for f in gains}
        for f in dropped:
            gain = self.tracks["gain"].get(f.row)
            if gain is not None and f.row not in moved and not gain.held:
                follow(self.tracks["level"][f.row], self.bands.window)

    def _input_carried(self, found: Finding, out: Collection[str], inputs: dict[str, str]) -> bool:
        """Whether a module judged by its std, out, moved less than its input: its gain went the other way, out.

        Its gain out of its range the other way (past a gain finding's margin and its noise) says the module before
        it moved further than this one at the step, within the input's own range (``out``: the rows out at the step;
        an input out is the cause, named first by forward order, and this module its victim): the move came through
        its input, and the module passes on less of it than usual: not named at the step (its range does not follow:
        a step of its own that stays is named at the next point). ``inputs``: ``_before()`` at the step.
        """
        before = inputs.get(found.row)
        if found.figure != "level" or before is None or before in out:
            return False
        gain = self.tracks.get("gain", {}).get(found.row)
        if gain is None or not gain.deviation * found.moved < 0 or not (gain.up if gain.deviation > 0 else gain.down):
            return False  # not the other way, or a deviation from before (a gain learning fast holds no sum)
        return abs(gain.deviation) > max(gain.noise, self._margin("gain", gain.deviation > 0))

    def _level_agrees(self, found: Finding) -> bool:
        """Whether a module's own outputs moved the way its gain did, at least ``AGREE`` as far (from their median).

        A gain that fell while the outputs rose is the module before it rising faster (a saturating
        layer that does not pass it on): that module's move, not this one's fault; and likewise up. Nor
        does a gain that led its input's lean (``_input_led``) stand where it fell while the outputs rose, in a
        module with no weights of its own (where update ratios are logged, none of its own comes in): how much of
        its input an activation passes is its input's distribution's (a pre-activation ResNet's first ReLU passing
        20% less of a convolution that grew x1.5, its std above its median, is no collapse of its outputs). A gain
        that led upward keeps the rule whatever the module (a fault's hook on a module, its std pulled back by the
        loss shrinking its input).
        """
        track, level = self.tracks.get("level", {}).get(found.row), self.levels.get(found.row, 0.0)
        if track is None or not track.logs or not level > 0:
            return True
        moved = math.log(level) - statistics.median(track.logs)
        along = moved * math.copysign(1.0, found.moved)
        weightless = bool(self.weighted) and found.row not in self.weighted and found.row not in self.lookups
        passes = found.moved < 0 and along < 0 and weightless  # an activation passing less of a grown input
        return along >= AGREE * abs(found.moved) or (not passes and not self._input_led(found))

    def _input_led(self, found: Finding) -> bool:
        """Whether the std of the module before ``found``'s leaned out of range as early as its gain did, or earlier.

        A gain moved by its input moves with it, from the same point (or its input moved within its range,
        nothing held, or out past a finding's factor); an input leaning out, still within that, that began
        1 to ``LEAD`` points after the gain had follows the module (a gain out long before is no cause of it): a loss
        pulling a module's growing outputs back shrinks the modules before it (Adam, a regression), which
        the gain's own move led.
        """
        before = self._before().get(found.row)
        gain, track = self.tracks["gain"].get(found.row), self.tracks["level"].get(before or "")
        if gain is None or track is None or not 0 < len(gain.held) - len(track.held) <= LEAD or not track.held:
            return True
        floor = least_change("level", self.bands)
        return not -2 * floor <= track.deviation <= floor  # the input out past a finding's factor: its own move

    def _before(self) -> dict[str, str]:
        """Each module with a finite std at the step, by the one before it in forward order (of those).

        A block of a stack watched beside the modules inside it (``_containers``) comes after them in
        forward order, but its input is what came before them: the one before its first inner module. A
        layer's gain is against the layer before it, blocks passed over: a block watched changes no layer's
        gain (a network without normalisation, growing as a whole, holds its head's gain against its last
        convolution, not against the stream). An attention's projections run before it of the same input (a key's
        query) are passed over too: a key's input is its query's.
        """
        rows = sorted((r for r, v in self.levels.items() if math.isfinite(v) and v >= 0),
                      key=lambda row: self.depth.get(row, 0))
        before, blocks = {}, self._containers()
        for i, row in enumerate(rows):
            j = i - 1
            if row in blocks:  # its input: what came before the modules inside it
                while j >= 0 and rows[j].startswith(row + "."):
                    j -= 1
            else:  # a layer's gain as it was without the blocks watched: against the layer before it
                while j >= 0 and (rows[j] in blocks or siblings(row, rows[j])):  # a key's input is its query's too
                    j -= 1
            if j >= 0:
                before[row] = rows[j]
        return before

    def _gains(self) -> dict[str, float]:
        """Each module's activation std over the one's before it in forward order: its gain."""
        return {row: self.levels[row] / self.levels[before] for row, before in self._before().items()
                if self.levels[before] > 0}
