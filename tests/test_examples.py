"""The examples run end to end and print what the README says they print."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each runs an example script in a new interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def run_example(name: str, out_dir) -> str:
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, f"{name}.py"), str(out_dir / "logs")],
        capture_output=True, text=True, timeout=240, cwd=out_dir,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])},  # this checkout
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("quickstart", [r"\d+ histogram series, \d+ scalar series", r"Hooks left on the model after fit: 0"]),
        ("exploding_lr", [
            r"Training stopped at global step 6 of 160 planned",
            r"Parameters all finite after the stop \(the last, NaN update was dropped\): True",
            r"first non-finite output: module 'net\.1'",
        ]),
        ("vanishing_sigmoid", [
            r"anomalies/vanishing/group0\s+flagged on\s+(\d+) of \1 steps",
            r"anomalies/vanishing\s+flagged on\s+0 of \d+ steps",
        ]),
        ("dead_relu", [r"net\.3\s+1\.000\s+1\.000\s+DEAD", r"Dead ReLUs: net\.3\."]),
        ("feature_extraction", [r"saved features equal the encoder's output: True"]),
        ("loss_spike_rollback", [
            r"unprotected: .* parameters finite: False", r"rollback: .* parameters finite: True",
            r"step 45 went back to the state before step 40; updates dropped: 4",
        ]),
        ("layer_health", [
            r"dead units: zero fraction of outputs, highest\n(\s+net\.[35] .*\n){2}",
            r"update ratio: farthest from 0\.001\n\s+net\.6 ",
            r"health/activation_histograms\s+4 images of 1280x480 px, at steps \[0, 19, 39, 59\]",
        ]),
        ("update_ratio", [r"net\.0\.weight .* too fast", r"net\.2\.weight .* ok", r"net\.4\.weight .* too slow"]),
    ],
)
def test_example_prints_what_the_readme_promises(tmp_path, name, expected):
    out = run_example(name, tmp_path)
    for pattern in expected:
        assert re.search(pattern, out), f"{pattern!r} not in the output of {name}:\n{out[-3000:]}"
