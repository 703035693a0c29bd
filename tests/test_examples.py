"""The examples run end to end and print what the README says they print."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each runs an example script in a new interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


# Run a script as if ``hide`` were not installed: no module, no distribution (torchmetrics asks for both).
_WITHOUT = """
import importlib.metadata as metadata, os, runpy, sys
version = metadata.version
def hidden(name):
    if name.lower() == {hide!r}:
        raise metadata.PackageNotFoundError(name)
    return version(name)
metadata.version, sys.modules[{hide!r}], sys.argv = hidden, None, sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as `python script.py` does
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_example(name: str, out_dir, hide: str = "") -> subprocess.CompletedProcess:
    """Run an example as a user would, on this checkout; ``hide`` a package as if it were not installed."""
    script = os.path.join(EXAMPLES, f"{name}.py")
    command = [sys.executable, script, str(out_dir / "logs")]
    if hide:
        command = [sys.executable, "-c", _WITHOUT.format(hide=hide), script, str(out_dir / "logs")]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=240, cwd=out_dir,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])},  # this checkout
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("quickstart", [r"\d+ histogram series, \d+ scalar series", r"Hooks left on the model after fit: 0"]),
        ("exploding_lr", [
            r"The anomaly at step 5 .* steps 0-5 ran, so trainer\.global_step \(steps counted\) is 6, of 160 planned",
            r"Parameters all finite after the stop \(the last, NaN update was dropped\): True",
            r"first non-finite output: module 'net\.1'",
        ]),
        ("vanishing_sigmoid", [
            r"anomalies/vanishing/group0\s+flagged on\s+(\d+) of \1 steps",
            r"anomalies/vanishing\s+flagged on\s+0 of \d+ steps",
        ]),
        ("dead_relu", [r"net\.3\s+1\.000\s+1\.000\s+DEAD", r"Dead ReLUs: net\.3\."]),
        ("feature_extraction", [r"saved features equal the encoder's output: True", r"in dataset order: True",
                                r"sample 17 \(blob \d\): nearest \[.*\], 100% from the same blob"]),
        ("loss_spike_rollback", [
            r"unprotected: .* parameters finite: False", r"rollback: .* parameters finite: True",
            r"step 45 went back to the state before step 40; updates dropped: 4",
        ]),
        ("layer_health", [
            # The verdict, once: the planted dead layer first, then the fast one; nothing about ordinary norms.
            r"Layer health at step \d+: \d layers unhealthy now.*\n  dead units: zero fraction of outputs above 0\.8\n"
            r"    net\.3 .* since step 0\n",
            r"learning too fast: update ratio above its usual range.*\n\s+net\.6 ",
            r"health/activation_histograms/net\.3\s+4 images of 480x320 px, at steps \[0, 19, 39, 59\]",
        ]),
        ("update_ratio", [r"net\.0\.weight .* too fast", r"net\.2\.weight .* ok", r"net\.4\.weight .* too slow"]),
        ("layerwise_lr", [r"GradientTransform +\S+ +\S+ +1\.\dx", r"UpdateTransform +\S+ +\S+ +(9|1\d)\.\dx",
                          r"under UpdateTransform: 0\.(08|09|10|11|12)x", r"warned: GradientTransform: `scale`"]),
    ],
)
def test_example_prints_what_the_readme_promises(tmp_path, name, expected):
    proc = run_example(name, tmp_path)
    out = proc.stdout + proc.stderr  # what the terminal shows: Lightning's messages go to stderr
    assert proc.returncode == 0, out[-5000:]
    for pattern in expected:
        assert re.search(pattern, out), f"{pattern!r} not in the output of {name}:\n{out[-3000:]}"
    # Lightning's own noise is silenced by message; reports and verdicts are printed once.
    assert "LeafSpec" not in out and "Tip:" not in out, out[-3000:]
    assert out.count("Layer health at step") <= 1 and out.count("Gradient anomaly at step 5 ") <= 1, out[-3000:]


def test_the_layer_health_example_says_what_to_install_where_matplotlib_is_missing(tmp_path):
    proc = run_example("layer_health", tmp_path, hide="matplotlib")
    assert proc.returncode == 1
    assert "pip install -e '.[health]'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
