"""The fault sweep's twelfth unseen groups, ``unseen12`` and ``unseen12b``: small batches on more models and seeds.

Small batches made the judge's false alarms of ``unseen9b`` ... ``unseen11b`` (a batch's step on a slow lean, a
ReLU's sparsity, a ViT's projections learning): every figure is noisier there. Healthy, and a jump beside it:

- ``unseen12``: batch 4 on a BERT, a GPT-NeoX, the MLP-Mixer, the pre-activation ResNet, the ConvNeXt-style CNN,
  torch's post-norm ``nn.TransformerEncoder``, the MobileNet-like CNN and the wide GPT-2, at seed 0.
- ``unseen12b``: the small-batch cases of ``unseen9b`` ... ``unseen11b`` at seeds 1 and 2 (the wide MLP at batch
  4, the ViT at batch 4, the zoo's MLP at batch 2, the zoo's CNN at batch 4, the zoo's GPT-2 at batch 2).
"""

from __future__ import annotations

from benchmarks import _sweep_unseen11  # noqa: F401  (adds the unseen9 ... unseen11 recipes)
from benchmarks._sweep_variant import Variant

PAIR = ("healthy", "jump")


def unseen12() -> dict[str, list[Variant]]:
    """The groups: ``unseen12`` (batch 4 on more models), ``unseen12b`` (small batches at seeds 1 and 2)."""
    first = [Variant("unseen12", m, PAIR, batch=4) for m in
             ("bert", "neox", "mixer", "resnet-preact", "convnext", "tfenc", "mobilenet", "gpt2-w192")]
    second = [Variant("unseen12b", m, PAIR, batch=b, seed=s) for s in (1, 2) for m, b in
              (("mlp-wide", 4), ("vit", 4), ("mlp", 2), ("cnn", 4), ("gpt2", 2))]
    return {"unseen12": first, "unseen12b": second}
