"""The judge's reading of the prediction layer's pull: growth the loss asks for, an overshoot (host-side, torch-free).

The pull is LayerHealth's ``sum(y * dL/dy)`` of the last module's output ``y`` (the figure
``pull``; ``callbacks/_loss_pull.py``): the loss's derivative in the scale of ``y``. Below 0 the
loss asks for a larger output, above 0 for a smaller one (docs/verdicts.md, "The prediction
layer: growth the loss asks for").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from lightning_hooks.output._findings import RELATIVE, Finding

#: The figure of ``sum(y * dL/dy)`` of a module's output ``y``: below 0 the loss asks for a larger output.
PULL = "pull"
#: The prediction layer overshooting (the loss asks for less) is named before the modules before it where it moved
#: this many times as far (log) as each of them: under SGD its jump's gradient moves their weights in the same step.
OVERSHOOT = 2.0
#: Whether the loss asks for the prediction layer's growth is read from the mean of its last this many logged pulls:
#: one small batch's pull can take either sign.
PULL_POINTS = 2
#: At the prediction layer's first point out (not by a step), its strongest ask over its last this many logged pulls
#: counts (``_judge_learning.py``: ``_asked_or_learned``): a growth asked for over the warm-up's last points.
ASK_POINTS = 8


def prediction_blowup(found: Finding, last: str | None, named: Collection[str]) -> bool:
    """Whether ``found`` is the prediction layer's ``blowup``, not named yet: the finding its pull may excuse.

    Below 0 the loss asks for a larger output: learning (``_judge_learning.py``: ``_asked_or_learned``).

    Args:
        found: A finding of a module's outputs.
        last: The last module in forward order: its output feeds the loss.
        named: The layers named and still out: a layer named already stays named while it is out.
    """
    return found.problem == "blowup" and found.row == last and found.row not in named


def overshot(outputs: Sequence[Finding], last: str | None, pulls: Mapping[str, float]) -> str | None:
    """The prediction layer, where it blew up while the loss asks for less, ``OVERSHOOT`` times past the modules before.

    A jump in the last module sends its gradient, as large, to every module before it; under SGD
    their weights move in the same step, and at the next logged step they are out too, by far
    less (the sweep's MLP: ``model.8`` x2.2, the culprit ``model.10`` x57 beyond its range). A
    culprit before it moves the last module's outputs with their inputs, no further.

    Args:
        outputs: The step's findings of the modules' outputs.
        last: The last module in forward order.
        pulls: The step's pull by module.
    """
    own = [f.moved for f in outputs if f.layer == last and f.problem == "blowup"]
    before = [abs(f.moved) for f in outputs if f.layer != last and f.problem in RELATIVE["level"]]
    if own and last is not None and pulls.get(last, 0.0) > 0 and own[0] > OVERSHOOT * max(before, default=0.0):
        return last
    return None
