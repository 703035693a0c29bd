"""examples/attention_collapse.py: without QK-norm the warnings lead the loss spike by k steps; with it, healthy."""

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.test_examples import EXAMPLES, ROOT

pytestmark = pytest.mark.slow  # two 400-step fits in a new interpreter, about 30 s of CPU


def test_attention_logits_and_entropy_warn_k_steps_before_the_loss_spikes_and_qk_norm_keeps_it_healthy(tmp_path):
    proc = subprocess.run(  # stderr (Lightning's log, the diagnosis) in order with stdout
        [sys.executable, os.path.join(EXAMPLES, "attention_collapse.py"), str(tmp_path / "logs")], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:]
    without, _, with_norm = out.partition("with QK-norm")
    spike = int(re.search(r"loss spike: step (\d+)", without)[1])
    warning = re.search(r"first warning: (attention_logits|entropy_collapse) in blocks\.\d\.attn at step (\d+)",
                        without)
    k = int(re.search(r"k = (\d+): the warning came", without)[1])
    assert k == spike - int(warning[2]) and k >= 100, without[-3000:]
    if torch.__version__.startswith("2.13."):  # the steps README.md and the example's docstring give for it
        assert (warning[1], int(warning[2]), spike, k) == ("entropy_collapse", 67, 339, 272), without[-3000:]
        assert ("blocks.0.attn: attention logit growth since step 69, worst 1.793e+04, 598x the bound 30;"
                " it was 1.185 at step 0") in without
    # The diagnosis, printed once per fit: attention logits far above the band, QK-norm among the remedies.
    assert re.search(r"blocks\.\d\.attn: attention logit growth since step \d+, worst [\d.e+]+, \d+x the bound 30",
                     without)
    assert "QK-norm: a LayerNorm or RMSNorm on q and k" in without
    assert "loss spike: none" in with_norm and "healthy (no layer out of its usual range" in with_norm
    assert "first warning" not in with_norm
