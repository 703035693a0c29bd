"""The fault sweep's ``lastblock`` group: the fault in the last block of a depth gradient (issue 29).

In an MLP-Mixer (and a pre-activation ResNet without normalisation) each block's outputs grow more
than the block's before while healthy; the judge clears such a gradient over depth
(``lightning_hooks/output/_peers.py``). This group holds that clearance to its price: a real fault
*in* the last block, which has no copy after it, must still be named at once.

- ``lastblock``: the Mixer's last token-mixing layer (``blocks.3.token_fc1``), the pre-activation
  ResNet's last convolution (``blocks.3.conv2``), each ramping, jumping and going dead; LLaMA's last
  block's MLP output (jump, dead) and attention output (ramp, jump).
"""

from __future__ import annotations

from benchmarks._sweep_variant import Variant

FAULTS = ("healthy", "ramp", "jump", "dead")


def lastblock() -> dict[str, list[Variant]]:
    """The group ``lastblock``: a fault in each model's last block."""
    llama = "net.model.layers.5"
    return {"lastblock": [Variant("lastblock", "mixer", FAULTS, target="blocks.3.token_fc1"),
                          Variant("lastblock", "resnet-preact", FAULTS, target="blocks.3.conv2"),
                          Variant("lastblock", "llama", ("jump", "dead"), target=f"{llama}.mlp.down_proj"),
                          Variant("lastblock", "llama", ("ramp", "jump"), target=f"{llama}.self_attn.o_proj")]}
