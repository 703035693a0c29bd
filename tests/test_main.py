"""``python -m lightning_hooks``: the environment report, run as a user runs it."""

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata

import pytest
import torch

import lightning_hooks

PACKAGE = os.path.dirname(os.path.abspath(lightning_hooks.__file__))
REQUIRE_NATIVE = os.environ.get("LIGHTNING_HOOKS_REQUIRE_NATIVE") == "1"
pytestmark = pytest.mark.slow  # each test runs the report in a new interpreter (about 10 s apiece)


def rows(text: str) -> dict[str, str]:
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in text.splitlines())


def report(cwd=None, **env: str) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-m", "lightning_hooks"], capture_output=True, text=True, timeout=120,
                          cwd=cwd or os.path.dirname(PACKAGE), env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return rows(done.stdout)


def copy_with_kernel(tmp_path, source: str):
    """This package's Python sources under ``tmp_path``, with ``source`` in place of the compiled kernel.

    A module, not a missing file: an editable install would find the repository's build instead.
    """
    skipped = shutil.ignore_patterns("*.so", "*.pyd", "__pycache__")
    shutil.copytree(PACKAGE, tmp_path / "lightning_hooks", ignore=skipped)
    (tmp_path / "lightning_hooks" / "measure" / "_cstats.py").write_text(source)
    return tmp_path


@pytest.fixture(scope="module")
def installed() -> dict[str, str]:
    """The report of this environment, run once for the tests that read it."""
    return report()


def test_the_report_lists_the_versions_installed(installed):
    got = installed
    assert got["lightning_hooks"] == lightning_hooks.__version__
    assert got["torch"].startswith(f"{torch.__version__} (")
    for name, distribution in [("lightning", "lightning"), ("pytorch_lightning", "pytorch-lightning"),
                               ("tensorboard", "tensorboard"), ("torchmetrics", "torchmetrics")]:
        assert got[name] == metadata.version(distribution)
    assert got["torch threads"].startswith(f"{torch.get_num_threads()} (")
    assert got["FastTensorBoardLogger checksum"].startswith(("C (", "numpy ("))


@pytest.mark.skipif(not REQUIRE_NATIVE, reason="set LIGHTNING_HOOKS_REQUIRE_NATIVE=1 where the kernel is built")
def test_a_built_kernel_is_on_and_says_whether_it_uses_avx2(installed):
    from lightning_hooks.measure import _native

    got = installed
    assert got["native C kernel"].startswith("on (") and got["native C kernel"].endswith(".so)")
    before = _native.cstats.set_avx2(True)
    _native.cstats.set_avx2(before)
    assert (got["AVX2"] == "on") if before else got["AVX2"].startswith("off (")
    assert got["FastTensorBoardLogger checksum"].startswith("C (")


def test_the_report_says_why_the_kernel_is_off(tmp_path):
    assert report(LIGHTNING_HOOKS_NATIVE="0")["native C kernel"].startswith("off: disabled by LIGHTNING_HOOKS_NATIVE=0")
    failed = copy_with_kernel(tmp_path / "failed", "raise ImportError('undefined symbol: PyLong_Foo')\n")
    got = report(cwd=failed)
    assert got["native C kernel"].startswith("off: not built or not loadable (undefined symbol: PyLong_Foo)")
    assert got["AVX2"] == "n/a (no native kernel)"
    # the copy has no build
    assert got["FastTensorBoardLogger checksum"].startswith("numpy (the C extension was not built")
    stale = copy_with_kernel(tmp_path / "stale", "ABI_VERSION = 1\n")  # what an old build reports
    assert report(cwd=stale)["native C kernel"].startswith("off: stale build (ABI 1, this version needs ")


def test_help_says_what_the_command_does_and_a_wrong_argument_fails():
    run = [sys.executable, "-m", "lightning_hooks"]
    cwd = os.path.dirname(PACKAGE)
    done = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m lightning_hooks [-h]")
    assert "Print a report of this environment" in done.stdout and "native C kernel" not in done.stdout
    done = subprocess.run([*run, "--verbose"], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert done.returncode == 2 and "unrecognized arguments: --verbose" in done.stderr and not done.stdout
