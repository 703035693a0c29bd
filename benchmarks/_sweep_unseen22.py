"""The fault sweep's twenty-second to twenty-ninth unseen groups: random faults on recipes varied at random too.

- ``unseen22``: 48 faulty cases drawn (``random.Random(22)``) as ``unseen18``'s are (any module with weights from
  the middle 60% of any of the 52 models, a ramp or a jump three times as often as dead units, a vanishing signal or
  a NaN), with wider rates (ramps 0.8-8% a step, jumps x3 to x60) and onsets (25-75% of the run), on a recipe that
  is varied at random once per model: its seed (1-3), its learning rate (x0.5, x1 or x2 the recipe's), its run length
  (200, 300 or 400 steps) and its log interval (every 1, 2, 2 or 5 steps); and each varied recipe's healthy run.
- ``unseen23``: drawn the same way (``random.Random(23)``), after the judge was changed on ``unseen22``.
- ``unseen24``: drawn the same way (``random.Random(24)``), after every rule written on ``unseen22``.
- ``unseen25``: drawn the same way (``random.Random(25)``), at the start of the next session (the neighbours rule was
  written on it); ``unseen26`` (``random.Random(26)``) held out, recorded after that session's rules.
- ``unseen27``: drawn the same way (``random.Random(27)``), at the start of the session after (its dead-units rule
  was written on it); ``unseen28`` (``random.Random(28)``) held out, recorded after that session's rules.
- ``unseen29``: drawn the same way (``random.Random(29)``), held out, recorded after the next session's rules (a
  layer carried by the network's growth; issue 29).
- ``unseen30``: drawn the same way (``random.Random(30)``), held out, recorded at the start of the session after (the
  judge of 9859e9d, the first group graded with faults that never ran left out).
- ``unseen31``: drawn the same way (``random.Random(31)``), recorded at the start of the session after (the judge of
  df65b92: a layer whose own weights surge, the head's ask over 8 pulls), held out until the same session wrote a
  rule on its Qwen2 (a block's layer traced back through the modules before it that moved with it).
- ``unseen32``: drawn the same way (``random.Random(32)``), held out, recorded after that session's rules.
- ``unseen33``: drawn the same way (``random.Random(33)``), recorded at the start of the session after (the judge of
  4378e9d); ``unseen34`` and ``unseen35`` held out, recorded after that session's rules.
- ``unseen36``: drawn the same way (``random.Random(36)``), recorded at the start of the session after (the judge of
  ef2d397); ``unseen37`` held out, recorded while that session's second rule was written, read after both;
  ``unseen38`` held out, drawn and recorded after both.
- ``unseen39``: drawn the same way (``random.Random(39)``), recorded at the start of the session after (the judge of
  3b16a53).
- ``unseen40``: drawn the same way (``random.Random(40)``), recorded at the start of the session after (the judge of
  4bf9d38), held out until that session's rules were final.
- ``unseen41``: drawn the same way (``random.Random(41)``), recorded at the start of the session after (the judge of
  1512f64), held out until that session's rules were final.
- ``unseen42``: drawn the same way (``random.Random(42)``), recorded at the start of the session after (the judge of
  c61d443); its two misses (a healthy GPT-2 at twice its LR, and its vanish twin) were read to write that session's
  rule.
- ``unseen43``: drawn the same way (``random.Random(43)``), recorded after that rule was final (the judge of 515cf28),
  held out from it; its U-Net miss (a jump in the judge's warm-up, logged every 5) was read to write the session's
  second rule.
"""

from __future__ import annotations

import random

from benchmarks._sweep_unseen18 import FAULTS, MODELS, OTHER_MODELS, WEIGHTS, _eligible
from benchmarks._sweep_variant import Variant
from benchmarks._zoo_models import RECIPES

CASES = 48


def unseen22() -> dict[str, list[Variant]]:
    """The groups ``unseen22`` to ``unseen43``: random faults on randomly varied recipes, and their healthy runs."""
    return {f"unseen{seed}": _drawn(f"unseen{seed}", seed) for seed in range(22, 44)}


def _drawn(group: str, seed: int) -> list[Variant]:
    """``CASES`` faults drawn with ``random.Random(seed)`` from all the models, each model's recipe varied once."""
    draw = random.Random(seed)
    recipes: dict[str, dict[str, float]] = {}
    cases, healthy = [], {}
    while len(cases) < CASES:
        model = draw.choice(MODELS + OTHER_MODELS)
        if not _eligible(model):
            continue
        if model not in recipes:
            recipes[model] = {"seed": draw.choice((1, 2, 3)), "lr": RECIPES[model].lr * draw.choice((0.5, 1.0, 2.0)),
                              "steps": draw.choice((200, 300, 400)), "every": draw.choice((1, 2, 2, 5))}
        r = recipes[model]
        target, fault = draw.choice(_eligible(model)), draw.choices(FAULTS, WEIGHTS)[0]
        onset = round(draw.uniform(0.25, 0.75), 2)
        growth, jump = round(draw.uniform(1.008, 1.08), 3), round(draw.uniform(3.0, 60.0), 1)
        common = {"steps": int(r["steps"]), "every": int(r["every"]), "lr": r["lr"], "seed": int(r["seed"])}
        cases.append(Variant(group, model, (fault,), target=target, onset=onset, growth=growth, jump=jump, **common))
        healthy.setdefault(model, Variant(group, model, ("healthy",), **common))
    return [*healthy.values(), *cases]
