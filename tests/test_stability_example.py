"""examples/attention_collapse.py: without QK-norm the warnings lead the loss spike by k steps; with it, healthy.

The claim is checked, not the steps: they depend on the CPU's vector instructions (CI runs this test
again under ``ATEN_CPU_CAPABILITY=avx2``). Measured on torch 2.13 under AVX-512, AVX2 and no vector
instructions: the first warning at step 47, the spike at 158, 192, 176 (k = 111, 145, 129).
"""

import os
import re
import subprocess
import sys

import pytest

from tests.test_examples import EXAMPLES, ROOT

pytestmark = pytest.mark.slow  # two 300-step fits in a new interpreter, about 25 s of CPU


def _run_example(tmp_path) -> tuple[str, str]:
    proc = subprocess.run(  # stderr (Lightning's log, the diagnosis) in order with stdout
        [sys.executable, os.path.join(EXAMPLES, "attention_collapse.py"), str(tmp_path / "logs")], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stdout[-5000:]
    without, _, with_norm = proc.stdout.partition("with QK-norm")
    return without, with_norm


def _last_and_floor(text: str) -> tuple[float, float]:
    found = re.search(r"loss over the last 10 steps: ([\d.]+) \(its floor ([\d.]+)\)", text)
    assert found is not None, text[-3000:]
    return float(found[1]), float(found[2])


def test_attention_logits_and_entropy_warn_well_before_the_loss_spikes_and_qk_norm_keeps_it_healthy(tmp_path):
    without, with_norm = _run_example(tmp_path)
    spike = re.search(r"loss spike: step (\d+)", without)
    warning = re.search(r"first warning: (attention_logits|entropy_collapse) in blocks\.\d\.attn at step (\d+)",
                        without)
    k = re.search(r"k = (\d+): the warning came", without)
    assert spike and warning and k, without[-3000:]
    # Well before: the measured k is 111 to 145 steps; half of the smallest is the margin.
    assert int(k[1]) == int(spike[1]) - int(warning[2]) >= 50, without[-3000:]
    last, floor = _last_and_floor(without)
    assert last > 1.5 * floor, without[-3000:]  # not a wobble: the run diverged (measured 3.9-4.1 over 2.1-2.2)
    # The diagnosis, printed once per fit: attention logits far above the band, QK-norm among the remedies.
    assert re.search(r"blocks\.\d\.attn: attention logit growth since step \d+, worst [\d.e+]+, [\d.e+]+x the bound 30",
                     without)
    assert "QK-norm: a LayerNorm or RMSNorm on q and k" in without
    assert "loss spike: none" in with_norm and "healthy (no layer out of its usual range" in with_norm
    assert "first warning" not in with_norm
    last, floor = _last_and_floor(with_norm)
    assert last < 1.1 * floor, with_norm[-3000:]  # measured within 2 % of the floor
