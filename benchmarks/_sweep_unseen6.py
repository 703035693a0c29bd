"""The fault sweep's sixth unseen groups, ``unseen6``, ``unseen6b`` and ``unseen6s`` (issue 29, item 2).

Architectures the judge never saw (models in ``benchmarks/_sweep_models6.py``), each at seed 0:

- ``unseen6``: a T5 encoder-decoder (the fault in the decoder's cross-attention output), a Mistral, a
  Mixtral (the fault in a block's fused experts), a Mamba (a mixer's ``out_proj``), a StableLM, a Cohere, a
  MobileNet-like CNN (a depthwise convolution), a DenseNet-like CNN (a layer whose output is concatenated)
  and a message-passing network on graphs (a node update): healthy, ramp and jump; on the T5, the Mixtral
  and the MobileNet also dead, LR x100 and NaN.
- ``unseen6b``: other positions: the T5's encoder MLP, the MobileNet's excitation Linear (its squeeze-and-
  excitation gate, before the hard sigmoid), the Mamba's ``in_proj``.
- ``unseen6s``: the T5, the Mixtral, the MobileNet, the Mamba (and its ``in_proj`` ramp) and the GNN at seed 1.
- ``unseen6c``: a BART (post-norm encoder-decoder, the fault in its decoder's cross-attention output); more
  faults on the cheap and the odd: the GNN dead, LR x100, NaN and its message Linear (before the neighbours'
  mean); the Mamba dead and NaN and its ``x_proj`` (the scan's input-dependent step size, B and C; its ``conv1d`` and
  ``dt_proj`` are used by their weights, never called, so never watched nor hurt); the
  DenseNet's transition convolution; the Cohere's and the StableLM's queries growing (``attn``).
"""

from __future__ import annotations

from benchmarks import _sweep_models6  # noqa: F401  (adds the unseen6 recipes)
from benchmarks._sweep_variant import Variant

FULL = ("healthy", "ramp", "jump")
MORE = ("dead", "lr100", "nan")
IN_PROJ = "net.backbone.layers.1.mixer.in_proj"  # the Mamba mixer's first Linear: both branches, x and the gate z


def _models() -> list[Variant]:
    more = ("t5", "mixtral", "mobilenet")
    return [Variant("unseen6", m, (*FULL, *(MORE if m in more else ()))) for m in
            ("t5", "mistral", "mixtral", "mamba", "stablelm", "cohere", "mobilenet", "densenet", "gnn")]


def _positions() -> list[Variant]:
    return [Variant("unseen6b", "t5", FULL[1:], target="net.encoder.block.1.layer.1.DenseReluDense.wo"),
            Variant("unseen6b", "mobilenet", FULL[1:], target="blocks.1.se.2"),  # the excitation's Linear
            Variant("unseen6b", "mamba", FULL[1:], target=IN_PROJ)]


def _more() -> list[Variant]:
    return [Variant("unseen6c", "bart", (*FULL, "dead")), Variant("unseen6c", "gnn", MORE),
            Variant("unseen6c", "gnn", FULL[1:], target="layers.1.message"),
            Variant("unseen6c", "mamba", ("dead", "nan")),
            Variant("unseen6c", "mamba", FULL[1:], target="net.backbone.layers.1.mixer.x_proj"),
            Variant("unseen6c", "densenet", FULL[1:], target="transition.2"),
            Variant("unseen6c", "cohere", ("attn",)), Variant("unseen6c", "stablelm", ("attn",))]


def _seeds() -> list[Variant]:
    models = ("t5", "mixtral", "mobilenet", "mamba", "gnn")
    return [*(Variant("unseen6s", m, FULL, seed=1) for m in models),
            Variant("unseen6s", "mamba", ("ramp",), target=IN_PROJ, seed=1)]


def unseen6() -> dict[str, list[Variant]]:
    """The groups: ``unseen6`` (new architectures), ``unseen6b`` (other positions), ``unseen6s`` (seed 1), more."""
    return {"unseen6": _models(), "unseen6b": _positions(),
            "unseen6s": _seeds(),
            "unseen6c": _more()}
