"""What the judge finds at a step, and the names it finds them by (host-side, torch-free).

The vocabulary of :mod:`lightning_hooks.output._judge` that LayerHealth's record, the Layers tab
and the absolute rules share: the relative figures with their problems, a :class:`Finding`, a
step's :class:`Judged`, and which module a row belongs to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: The relative figures, each with its (up, down) problems.
RELATIVE = {"level": ("blowup", "collapse"), "gain": ("blowup", "collapse"), "norm": ("exploding", "vanishing"),
            "ratio": ("too_fast", "too_slow"), "output_grad": ("output_grad_exploding", "output_grad_vanishing")}
#: The figure of the gradient reaching each module's output: judged in backward order (the last module first).
BACKWARD = "output_grad"
#: The problems seen in a module's own outputs: the evidence a culprit is named from, in forward order.
OUTPUT_PROBLEMS = ("nonfinite", "dead", "blowup", "collapse")
#: The update ratio of a norm's scale (a 1-D ``weight``), judged only by a step far above its own history:
#: its findings are the ``ratio`` figure's (``too_fast``), its rows kept apart from the other rows' ranges.
SCALE_RATIO = "scale_ratio"
#: The figures whose rows are parameters (or modules, with GradientMonitor's ``granularity="module"``).
PARAMETER_FIGURES = ("norm", "ratio", SCALE_RATIO)
#: The layer a data fault is reported on.
EVERY_LAYER = "(every layer)"


#: A parametrized module's parameter (``torch.nn.utils.parametrize``): ``<module>.parametrizations.<name>.original``.
_PARAMETRIZED = re.compile(r"(.+)\.parametrizations\.[^.]+\.original\d*")


def owner_of(name: str) -> str:
    """The module a parameter belongs to: its name without the last part.

    A parametrized module's parameters (``0.parametrizations.weight.original0``, ``.original1``,
    ``.original``) belong to the module itself (``0``), not to its ``parametrizations``.

    Example:
        >>> owner_of("net.0.bias"), owner_of("net.0.parametrizations.weight.original1")
        ('net.0', 'net.0')
    """
    if (found := _PARAMETRIZED.fullmatch(name)) is not None:
        return found.group(1)
    return name.rpartition(".")[0] or name


def layer_of(row: str, modules: Mapping[str, int]) -> str:
    """The module a row belongs to: the row itself if it is a known module, else :func:`owner_of` it.

    Module figures come first in each step, so that every watched module is known.
    """
    if row in modules or "." not in row:
        return row
    return owner_of(row)


def inner_first(names: Sequence[str]) -> list[str]:
    """``names`` (as rows first came: a container before the modules inside it), each after the modules inside it.

    A module's forward hook fires once the modules it calls have run: watched whole beside the
    layers inside it (a block of a stack, see ``stack_blocks``), it comes after them in forward order.

    Example::

        >>> inner_first(["h.0", "h.0.attn", "h.0.mlp", "h.1", "h.1.mlp", "head"])
        ['h.0.attn', 'h.0.mlp', 'h.0', 'h.1.mlp', 'h.1', 'head']
    """
    ordered: list[str] = []
    open_: list[str] = []  # the containers whose insides are still coming, innermost last
    for name in names:
        while open_ and not name.startswith(open_[-1] + "."):
            ordered.append(open_.pop())
        open_.append(name)
    return ordered + open_[::-1]


@dataclass
class Finding:
    """A row out of its range at a step: its layer, the problem, the value, and how far (log units) it moved."""

    row: str
    layer: str
    problem: str
    value: float
    figure: str  # the relative figure it was judged from, "peers" (a ratio far above the others'), or the stat
    moved: float = 0.0


@dataclass
class Judged:
    """One step's judgement: the findings named, those counted as victims, and the common move by figure."""

    named: list[Finding] = field(default_factory=list)
    victims: list[Finding] = field(default_factory=list)
