"""The judge's data rule: every layer at once, the batch rather than a layer (host-side, torch-free).

Part of :mod:`lightning_hooks.output._judge`: a step is a fault in the data (``(every layer)``,
"look at the batch") where the first module's outputs and at least half of all modules' went out
the same way together, or, with no layer singled out by its outputs, its output gradient or its
update ratio, where every gradient jumped together far beyond the batch-to-batch move they share
and stayed there the next logged step (a batch of wrong labels; a hard batch comes back).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Optional

from lightning_hooks.output._findings import BACKWARD, OUTPUT_PROBLEMS, RELATIVE, Finding
from lightning_hooks.output._health_bands import Bands
from lightning_hooks.output._row_range import Track

#: The gradients' jump is measured from the median of the common path's last this many logged points:
#: near convergence one easy batch drops every gradient for a point, and is no level to jump from.
REFERENCE_POINTS = 5


def outputs_out_together(found: Sequence[Finding], levels: Mapping[str, float], first: Optional[str]) -> bool:
    """Whether the first module's outputs and at least half of all modules' went out the same way."""
    if len(levels) < 3:
        return False
    for problem in RELATIVE["level"]:
        side = {f.row for f in found if f.problem == problem}
        if first in side and len(side) >= len(levels) / 2:
            return True
    return False


def singled_out(found: Sequence[Finding]) -> bool:
    """Whether a layer's outputs, its output gradient or its update ratio single one layer out."""
    return any(f.problem in OUTPUT_PROBLEMS or f.problem == "too_fast" or f.figure == BACKWARD for f in found)


def gradients_jumped_together(common: Track, move: float, now: float, bands: Bands) -> bool:
    """Whether every gradient jumped together at the step before and stayed up (updates ``common``).

    Args:
        common: The gradients' common track: ``logs`` their step-to-step common moves, ``held``
            their common path (log level), ``frozen``/``worst`` set the step after a jump.
        move: This step's common move of the gradient norms (log).
        now: This step's common level of the gradient norms (log).
        bands: The thresholds (``norm_factor``, ``cusum``, ``min_points``).
    """
    moves, path = common.logs, common.held
    limit = math.inf if len(moves) < bands.min_points else max(
        math.log(bands.norm_factor), bands.cusum * 1.4826 * statistics.median(abs(m) for m in moves))
    level = statistics.median(list(path)[-REFERENCE_POINTS:]) if path else now - move
    if common.frozen:  # the step after a jump: the batch's labels if the gradients stayed up, else a hard batch
        common.frozen = 0
        if now - common.worst > limit:
            return True
    elif move > limit and now - level > limit:
        common.frozen, common.worst = 1, level
        return False
    else:
        moves.append(move)
    path.append(now)
    return False
