"""One row's usual range on a log scale, and whether a new value is out of it (host-side, torch-free).

The per-row half of :mod:`lightning_hooks.output._judge` (docs/verdicts.md): a robust level and
trend from the row's last ``window`` values, its noise, and a two-sided CUSUM of the deviation
beyond that range in units of the noise. While the row leans out its values are held back from
its range, so that a ramp cannot widen it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from lightning_hooks.output._health_bands import Bands

#: The least noise (log units) of each relative figure: 5% for outputs, 2% for a module's gain (its outputs
#: against its inputs'), 25% for gradients (of parameters or of outputs), 10% for ratios.
MIN_NOISE = {"level": math.log(1.05), "gain": math.log(1.02), "norm": math.log(1.25), "ratio": math.log(1.1),
             "output_grad": math.log(1.25)}
#: A row that drifted out slower than this (log) a step since it leaned is learning, not a blow-up (x1.35 in
#: 100 steps): a healthy layer's slow creep late in a long run (GPT-2's attention, 0.25% a step) is not
#: named; the slowest fault ramp of the sweep (0.5% a step) gets past it. Measured in steps, not logged points.
CREEP_PER_STEP = math.log(1.003)
#: A row whose noise is under this share of its figure's floor (``MIN_NOISE``) is quiet: its values let in beyond its
#: range point after point are a creep's, not its noise, and are left out of the range the next is judged by.
QUIET_SHARE = 0.25
#: The figures judged so: a module's outputs (a gradient's norm is judged by its peers' common move too).
CREPT = ("level", "gain")
#: The band (a field ``<name>_factor`` of :class:`Bands`) each relative figure is judged by: a gain is an output's.
FACTOR = {"level": "level", "gain": "level", "norm": "norm", "ratio": "ratio", "output_grad": "output_grad"}
#: A gain's least change, as a power of ``level_factor`` (1.25 ** 0.7 = 1.17): the batch's share of an output's
#: moves, which the factor's margin is for, is taken out of a gain by the module before it.
GAIN_POWER = 0.7
#: Before a row is judged by its range (its first ``min_points`` values and the judge's warm-up in steps), an
#: output (its std or its gain) this far (log) above every value its history holds, from ``WARM_POINTS`` values on,
#: is a finding: a step no early learning takes (healthy: at most x2.4 over every recorded case).
WARM_JUMP = math.log(5.0)
#: ... and an output this far (log) below every value its history holds: a fall twice as far as a jump, as after the
#: warm-up (healthy: at most x0.31 over every recorded case; a layer's weights shrunk x0.01 fall x0.009 at once).
WARM_FALL = 2 * WARM_JUMP
WARM_POINTS = 4
#: A Gaussian row's lowest point in a window of 24-32 lies about 2 noises below its line; one further than this
#: many noises below it has a long lower tail (``_lower_tail``), which a fall is judged by.
LOWER_TAIL = 3.0
#: A lean has slowed to a creep where its deviation's median over its last this many held points moved less than
#: ``CREEP_PER_STEP`` a step from the median of the as many before (a healthy layer learning fast, then slower).
SLOW_POINTS = 8
#: A lean's pace (``slow_paced``) is the median deviation of its newest this many points: one batch's step is not it.
PACE_POINTS = 3
#: The rows' ranges judge from this many steps per ``min_points`` on (48): logged every step, a small model's
#: fastest learning (the zoo's MLP: layers moving 20-80% over steps 25-60) is history, as logged every 2.
WARM_STEPS_PER_POINT = 2
#: Logged every 6 steps or more, a row's range judges from ``COARSE_POINTS`` values once they span this many steps per
#: ``min_points`` (120): logged every 20, ``min_points`` values would take 480 steps, and a ramp begun before would
#: be the row's own history. Not fewer steps: logged every 5, an embedding still learns fast at step 50 (10 points).
COARSE_STEPS_PER_POINT = 5
COARSE_POINTS = 8


@dataclass
class Track:
    """One row's history on a log scale and its CUSUM sums; ``frozen`` counts the points its level is held."""

    logs: deque[float]
    up: float = 0.0
    down: float = 0.0
    frozen: int = 0
    worst: float = 0.0
    held: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    deviation: float = 0.0
    noise: float = math.inf  # the last noise measured from its history (log units), unfloored
    learned: int = 0  # the newest values let in as the row's own fast learning
    clock: int = 0  # the steps over the points judged (each point's ``gap`` added)
    held_at: deque[int] = field(default_factory=lambda: deque(maxlen=64))  # ``clock`` at each held value
    crept: int = 0  # the newest values let in beyond the range, each on the same side (+ above, - below)


def in_warm_up(track: Track, bands: Bands, joined: bool = False) -> bool:
    """Whether a row's own range cannot judge yet: fewer than ``min_points`` values, unless logged coarsely.

    Logged every 6 steps or more, ``COARSE_POINTS`` values that span ``COARSE_STEPS_PER_POINT * min_points`` steps
    (the steps each point adds counted in ``clock``) are enough. ``joined``: whether the row's newest point is in its
    history already, asked as its point was judged (counted out).
    """
    n = len(track.logs) - joined
    return n < bands.min_points and (n < COARSE_POINTS or track.clock < COARSE_STEPS_PER_POINT * bands.min_points)


def usual_range(logs: Sequence[float]) -> tuple[float, float, float, float]:
    """A row's usual range from its history (log values, oldest first): level, slope, lag and noise.

    The level is the median of the newer half, ``lag`` points behind the next point; the slope,
    per point, the move from the older half's median to the newer half's; the noise, the median
    absolute deviation of the points from that line (times 1.4826: a standard deviation for
    Gaussian noise).
    """
    values = list(logs)
    half = len(values) // 2
    old, new = statistics.median(values[:half]), statistics.median(values[half:])
    slope = (new - old) / max(1, len(values) - half)
    centre = (len(values) + half - 1) / 2  # where the newer half's median sits
    noise = 1.4826 * statistics.median(abs(v - new - slope * (i - centre)) for i, v in enumerate(values))
    return new, slope, len(values) - centre, noise


def step_noise(moves: Sequence[float]) -> float:
    """A row's noise from its point-to-point ``moves``: their spread about their median, over sqrt(2).

    A row that learned along a curve (fast early, slow later) strays far from any one straight
    line through its window, yet each point sits close to the one before: its moves are the noise.
    A value is judged against the smaller of the two (the line's noise still says which of a
    module's figures, its std or its gain, is the quieter).
    """
    if len(moves) < 2:
        return math.inf
    typical = statistics.median(moves)
    return 1.4826 * statistics.median(abs(m - typical) for m in moves) / math.sqrt(2)


def track_state(track: Track) -> list:
    """A track as plain values (for a checkpoint); :func:`track_from_state` restores it."""
    return [list(track.logs), track.up, track.down, track.frozen, track.worst, list(track.held), track.deviation,
            track.noise, track.learned, track.clock, list(track.held_at), track.crept]


def track_from_state(state: Sequence, window: int) -> Track:
    """The track of :func:`track_state`'s values."""
    logs, up, down, frozen, worst, held, deviation, noise, learned, clock, held_at, *crept = state
    return Track(deque(logs, maxlen=window), up=up, down=down, frozen=frozen, worst=worst,
                 held=deque(held, maxlen=64), deviation=deviation, noise=noise, learned=learned,
                 clock=clock, held_at=deque(held_at, maxlen=64), crept=crept[0] if crept else 0)


def least_change(figure: str, bands: Bands) -> float:
    """The least move (log) of a row of ``figure`` that is a finding, upward (downward: twice as far)."""
    return math.log(getattr(bands, f"{FACTOR[figure]}_factor")) * (GAIN_POWER if figure == "gain" else 1.0)


def settle_at(track: Track, points: int, window: int) -> None:
    """Let a row settle at the level of its newest ``points`` held values, without the move that took it there.

    Its history is shifted to that level and the points join it: the range is the new level with the row's old
    spread, and no trend (the move, let in as :func:`follow` does, would carry on as the row's own slope and take
    a later ramp for more of it).
    """
    flat = [x for x in list(track.held)[-points:] if math.isfinite(x)]
    if not flat or not track.logs:
        return
    shift = statistics.median(flat) - statistics.median(track.logs)
    track.logs = deque([x + shift for x in track.logs] + flat, maxlen=window)
    track.learned = track.crept = 0
    _settle(track, window)


def follow(track: Track, window: int) -> None:
    """Let the values a row held back join its history, as its own learning: its range follows them."""
    track.logs.extend(track.held)
    track.crept = 0
    _settle(track, window)


def judge_value(track: Track, x: float, figure: str, bands: Bands, warm: bool = True, gap: int = 1) -> Optional[float]:
    """Add one log value to a row's track; its deviation from its range if that is a finding, else None.

    Before ``min_points`` values (fewer logged coarsely: :func:`in_warm_up`), or while not ``warm`` (the judge's
    warm-up in steps), the value only joins the row's history.

    A finding needs the CUSUM past ``bands.cusum`` noises, and the deviation past the figure's
    factor up (its square down). Values seen while the row leans out are held back from its
    level: let in if it comes back or the drift never adds up to a finding, or as its new level
    if it drifted just past its range and settled there (learning); a row that went out by a step
    stays out until it comes back. A row that drifted out slower than ``CREEP_PER_STEP`` a step
    (``gap``: the steps from the logged point before) is held as a drift, not named.
    Before that, an output out by a step past ``WARM_JUMP`` up or ``WARM_FALL`` down (:func:`jumped_early`) is a
    finding.
    """
    track.clock += gap
    if in_warm_up(track, bands) or not warm:
        jumped = jumped_early(track, x, figure)
        if jumped is not None:
            _hold(track, x)  # out by a step: held, let in if an excuse says learning (follow)
        elif math.isfinite(x):
            _release(track)  # back in: the step was not its level
            track.logs.append(x)
        return jumped
    floor = least_change(figure, bands)
    deviation, noise = _deviation(track, x, figure, floor)
    if deviation is None:
        return None
    track.deviation = deviation
    track.up = max(0.0, track.up + deviation - noise)
    track.down = max(0.0, track.down - deviation - noise)
    leaning = bool(track.up or track.down)
    out = max(track.up, track.down) > bands.cusum * noise and (deviation > floor or deviation < -2 * floor)
    slow = out and creeping(track, deviation, gap)
    waits = out and not slow and slow_paced(track, deviation, gap, floor)  # one batch out on a slow lean: wait
    if out and not slow and not waits:
        track.frozen += 1
        if abs(deviation) > abs(track.worst) + max(noise, floor):  # still moving away
            track.worst, track.frozen = deviation, 0
        _hold(track, x)
        if track.frozen < bands.min_points or abs(track.worst) > 2 * floor:
            return deviation
        track.logs = deque(track.held, maxlen=bands.window)  # settled: learning, at a new level
        track.crept = 0
    elif leaning:
        _hold(track, x)
        track.frozen += 1
        if track.frozen < bands.min_points or waits:
            return None
        track.logs.extend(track.held)  # a drift too slow to add up: the level follows it
    else:
        track.logs.extend(track.held)
        track.logs.append(x)
        # Beyond the range, under the noise floor, on a row far quieter than it: a creep's step (a noisier row's is its
        # noise, judged by the range it widens).
        quiet = figure in CREPT and track.noise < MIN_NOISE[figure] * QUIET_SHARE
        side = (deviation > 0) - (deviation < 0) if quiet else 0
        track.crept = track.crept + side if side and side * track.crept >= 0 else side  # a run on one side
    _settle(track, bands.window)
    return None


def hold_newest(track: Track, x: float) -> None:
    """Take the row's newest point ``x`` back out of its history and hold it: a step another figure found.

    Held, it is named while it stays out (as a step of its own: :func:`judge_value`), and let in if it comes back.
    """
    if track.logs and track.logs[-1] == x:
        track.logs.pop()
        _hold(track, x)


def _hold(track: Track, x: float) -> None:
    """Hold ``x`` back from the row's history, with the steps at which it came (``clock``)."""
    track.held.append(x)
    track.held_at.append(track.clock)


def _release(track: Track) -> None:
    """Drop the values a row held back, and the steps they came at (:func:`_hold`)."""
    track.held.clear()
    track.held_at.clear()


def jumped_early(track: Track, x: float, figure: str) -> Optional[float]:
    """How far (log) an output's ``x`` is out of its short history by a step (``WARM_JUMP`` up, ``WARM_FALL`` down).

    Up: how far above every value it holds; down: how far below every value, negative. Else None.

    Judged from ``WARM_POINTS`` values on, while the row's range cannot judge yet (the first steps of
    training move every layer, but no layer of any recorded healthy run went x2.4 above all its values
    before, nor below x0.31). Such a value is held out of the row's history: it is named while it stays out, and
    its range is the one it left, unless an excuse (the loss asking for it, its kind or peers moving alike) lets it
    in as learning (:func:`follow`).
    """
    if FACTOR[figure] != "level" or len(track.logs) < WARM_POINTS or not math.isfinite(x):
        return None
    over, under = x - max(track.logs), min(track.logs) - x
    return over if over > WARM_JUMP else -under if under > WARM_FALL else None


def creeping(track: Track, deviation: float, gap: int) -> bool:
    """Whether a row out by ``deviation`` (log) drifted out slower than ``CREEP_PER_STEP`` a step.

    ``gap`` is the steps between logged points: the row has leaned for ``len(track.held) + 1`` points.
    Such a row is held as a drift (its level follows it after ``min_points`` points), not named.
    """
    return abs(deviation) < CREEP_PER_STEP * gap * (len(track.held) + 1)


def slow_paced(track: Track, deviation: float, gap: int, floor: float) -> bool:
    """Whether a lean's pace, its median deviation over its newest ``PACE_POINTS`` points, is a creep.

    One small batch (every module's std up x1.2 at once) on a healthy layer's slow lean is not the lean's
    pace: such a point waits for the next (named then if it stays out, a step; let in as the lean if not).
    A value out past twice ``floor`` (a jump) is judged by itself, as is a lean younger than the points.
    """
    if abs(deviation) > 2 * floor or len(track.held) < PACE_POINTS - 1:
        return False
    return creeping(track, statistics.median([*held_deviations(track)[-(PACE_POINTS - 1):], deviation]), gap)


def _seen(track: Track) -> list[float]:
    """The history a row's range takes its extremes from: not its newest values learned, nor a creep's own."""
    return list(track.logs)[:max(0, len(track.logs) - max(track.learned, abs(track.crept)))]


def held_deviations(track: Track) -> list[float]:
    """The deviation of each value a row holds back, beyond its (held) range at that value's point."""
    level, slope, lag, _ = usual_range(track.logs)
    seen = _seen(track)  # as ``_deviation``
    high, low = max([level, *seen]), min([level, *seen])
    return [max(0.0, x - max(high, level + slope * (lag + i))) + min(0.0, x - min(low, level + slope * (lag + i)))
            for i, x in enumerate(track.held)]


def came_back(track: Track) -> bool:
    """Whether a row leaning up was back within its range (or below it) at the point before its newest: no ramp's lean.

    A ramp's points lean further out one after the other; a noisy row's lean that one batch took back in, and the
    next took out again, hops. False with fewer than two values held (the newest starts the lean).
    """
    return len(track.held) >= 2 and bool(track.logs) and held_deviations(track)[-2] <= 0.0


def lean_slowed(track: Track, floor: float) -> bool:
    """Whether a row leaning out now moves away from its range slower than ``CREEP_PER_STEP`` a step.

    Its held values' deviations beyond its (held) range, the newest ``SLOW_POINTS`` against the as many
    before (or the newest alone, where it is further out: a step, or a ramp just begun on a slow lean): a
    layer whose learning sped it out of its range and then slowed (healthy GPT-2 under a one-cycle LR: 0.47%
    a step, then 0.1%) is not leaning away any more; a ramp keeps its pace. Only a row just past its range
    (within twice its least change ``floor``, as a drift that settles): one further out went there by a step or
    a fast ramp, and stays out. False with fewer held values, or more than the track keeps (their points unknown).
    """
    held = list(track.held)
    if (len(held) < 2 * SLOW_POINTS or len(held) == track.held.maxlen or not track.logs
            or len(track.held_at) != len(held)):  # steps unknown (a track held without them)
        return False
    devs = held_deviations(track)
    sign = math.copysign(1.0, track.deviation or devs[-1])  # the finding's way, where its newest is at the edge
    if abs(devs[-1]) > 2 * floor * (1 if sign > 0 else 2):
        return False
    now = max(sign * statistics.median(devs[-SLOW_POINTS:]), sign * devs[-1])  # a step or a ramp's start: the newest
    at = list(track.held_at)
    steps = statistics.median(at[-SLOW_POINTS:]) - statistics.median(at[-2 * SLOW_POINTS:-SLOW_POINTS])  # spanned
    return now - sign * statistics.median(devs[-2 * SLOW_POINTS:-SLOW_POINTS]) < CREEP_PER_STEP * steps


def _deviation(track: Track, x: float, figure: str, floor: float) -> tuple[Optional[float], float]:
    """How far (log) ``x`` is beyond the row's range, and its noise.

    The range spans its flat level, its own trend carried on, and the values its history holds (but
    the newest, if they came in as its own fast learning: a ramp riding on a trend does not widen its
    range): a row that swung as far within its window (a layer following a cyclic learning rate) is
    in range there.

    None while the row is still learning fast on its own and ``x`` is not a step away: its own
    history cannot judge it, and ``x`` joins it. A quiet row's newest values let in beyond the range point after
    point (``crept``) are not part of its extremes: a creep does not widen the range it is judged against.
    """
    level, slope, lag, noise = usual_range(track.logs)
    track.noise = noise
    ahead = level + slope * (lag + len(track.held))  # the row's own trend, carried on to this point
    if abs(ahead - level) > floor / 2 and not (track.up or track.down) and abs(x - level) < 2 * floor:
        track.logs.append(x)
        track.learned += 1
        track.crept = 0  # the row's own learning: no creep's run
        return None, noise
    if not math.isfinite(x):
        return -math.inf, max(noise, MIN_NOISE[figure])
    seen = _seen(track)
    track.learned = 0
    high, low = max(level, ahead, *seen), min(level, ahead, *seen)
    deviation, noise = max(0.0, x - high) + min(0.0, x - low), _judging_noise(track, noise, slope, floor)
    if deviation < 0:  # a std of a few values (a small batch's prediction) has a long lower tail on a log scale
        noise = max(noise, _lower_tail(track.logs, level, slope, lag))
    return deviation, max(noise, MIN_NOISE[figure])


def _lower_tail(logs: Sequence[float], level: float, slope: float, lag: float) -> float:
    """The noise a row's lowest point below its line implies: how far down its own history already went.

    ``LOWER_TAIL`` noises below the line is as far as a Gaussian row's lowest point goes in a window; a row
    that went further (a std of 4 values: its log is skewed down) is judged by that tail going down.
    """
    centre = len(logs) - lag  # where the line passes through ``level``, as ``usual_range`` draws it
    return -min(0.0, *(v - level - slope * (i - centre) for i, v in enumerate(logs))) / LOWER_TAIL


def _judging_noise(track: Track, noise: float, slope: float, floor: float) -> float:
    """The noise a value is judged by: the line's, or the moves' where the row learned along a settling curve.

    That is a row that moved past ``floor`` in its window, its newer half's moves under half its older
    half's (it learned fast, then slowed): only such a curve strays from one straight line by its
    shape. A steady row's misfit is its wander, which its moves do not show; a row whose learning
    speeds up (a layer waking up early in training) is still learning, its next moves unknown.
    """
    if abs(slope) * len(track.logs) / 2 <= floor:
        return noise
    logs = list(track.logs)
    moves = [b - a for a, b in zip(logs, logs[1:])]
    half = len(moves) // 2
    if abs(statistics.median(moves[half:])) >= abs(statistics.median(moves[:half])) / 2:
        return noise
    return min(noise, step_noise(moves))


def _settle(track: Track, window: int) -> None:
    """The row is in range again (or has a new level): its held values join its history, its sums restart."""
    track.logs = deque((v for v in track.logs if math.isfinite(v)), maxlen=window)
    _release(track)
    track.up = track.down = track.worst = 0.0
    track.frozen = 0
