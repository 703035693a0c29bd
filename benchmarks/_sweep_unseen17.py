"""The fault sweep's seventeenth unseen group: faults begun early, in or just after the judge's warm-up.

- ``unseen17``: a ramp (4% a step) and a jump (x20) at 12% and 16% of a 300-step run (steps 36 and 48; the rows'
  ranges judge from step 48) on GPT-2, LLaMA, the CNN and the MLP.
"""

from __future__ import annotations

from benchmarks._sweep_variant import Variant


def unseen17() -> dict[str, list[Variant]]:
    """The group ``unseen17``: early onsets."""
    return {"unseen17": [Variant("unseen17", m, ("ramp", "jump"), steps=300, onset=f)
                         for m in ("gpt2", "llama", "cnn", "mlp") for f in (0.12, 0.16)]}
