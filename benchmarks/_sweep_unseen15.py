"""The fault sweep's fifteenth unseen groups: schedules, optimizers and frozen layers none of the others held.

- ``unseen15``: cosine with warm restarts (SGDR: the LR back at its peak, for every layer at once, four times a run)
  on GPT-2 and the MLP (AdamW) and the CNN (SGD); RAdam, NAdam and Adamax on the MLP, NAdam on LLaMA.
- ``unseen15b``: fine-tuning's frozen layers: GPT-2's first block frozen for the whole run and thawed at 30%
  (its Adam state fresh among settled ones), the CNN's first block thawed at 30%, LLaMA's token embedding frozen,
  the MLP's first Linear thawed at 40%.
- ``unseen15c``: logged every 20 steps over 600 (30 points; the onset at 300) on GPT-2, the MLP and the CNN.
"""

from __future__ import annotations

from benchmarks._sweep_variant import Variant

ABRUPT = ("ramp", "jump")


def unseen15() -> dict[str, list[Variant]]:
    """The groups: ``unseen15`` (schedules, optimizers), ``unseen15b`` (frozen layers), ``unseen15c`` (every 20)."""
    first = [Variant("unseen15", "gpt2", ("healthy", *ABRUPT, "lr100"), optimizer="adamw-restarts", lr=1e-3),
             Variant("unseen15", "mlp", ("healthy", *ABRUPT), optimizer="adamw-restarts", lr=2e-3),
             Variant("unseen15", "cnn", ("healthy", *ABRUPT), optimizer="sgd-restarts", lr=0.05),
             Variant("unseen15", "mlp", ("healthy", *ABRUPT, "lr100"), optimizer="radam", lr=1e-3),
             Variant("unseen15", "mlp", ("healthy", *ABRUPT, "lr100"), optimizer="nadam", lr=1e-3),
             Variant("unseen15", "mlp", ("healthy", *ABRUPT), optimizer="adamax", lr=2e-3),
             Variant("unseen15", "llama", ("healthy", "ramp"), optimizer="nadam", lr=6e-4)]
    second = [Variant("unseen15b", "gpt2", ("healthy", *ABRUPT, "dead"), frozen="net.transformer.h.0"),
              Variant("unseen15b", "gpt2", ("healthy", "ramp"), frozen="net.transformer.h.0", thaw=0.3),
              Variant("unseen15b", "cnn", ("healthy", "ramp"), frozen="blocks.0", thaw=0.3),
              Variant("unseen15b", "llama", ("healthy", *ABRUPT), frozen="net.model.embed_tokens"),
              Variant("unseen15b", "mlp", ("healthy", "ramp"), frozen="0", thaw=0.4)]
    third = [Variant("unseen15c", m, ("healthy", *ABRUPT), every=20, steps=600) for m in ("gpt2", "mlp", "cnn")]
    return {"unseen15": first, "unseen15b": second, "unseen15c": third}
