"""``python -m lightning_hooks``: a report of the environment, to read when statistics are slow or for an issue.

It says which versions are installed, whether the native statistics kernel is on (and if
not, why: it was not built, it is stale, or ``LIGHTNING_HOOKS_NATIVE=0`` turned it off), whether
that kernel uses AVX2, how TensorBoard's record checksums are computed, and how many threads
torch uses.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from importlib import metadata
from types import ModuleType
from typing import Optional

import torch

import lightning_hooks
from lightning_hooks.measure import _native, stats

#: Distributions whose versions the report lists, by the name they import as.
_DISTRIBUTIONS = {"lightning": "lightning", "pytorch_lightning": "pytorch-lightning",
                  "tensorboard": "tensorboard", "torchmetrics": "torchmetrics"}


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def native_kernel() -> tuple[Optional[ModuleType], str]:
    """The compiled kernel module if it is in use (else None), and a line saying why or why not."""
    try:
        module = importlib.import_module("lightning_hooks.measure._cstats")
    except ImportError as err:
        return None, (f"off: not built or not loadable ({err}); reinstall where a C compiler (gcc or clang)"
                      " and the Python headers are found: `pip install --force-reinstall --no-deps lightning-hooks`")
    found = getattr(module, "ABI_VERSION", None)
    if found != _native.NATIVE_ABI:
        return None, (f"off: stale build (ABI {found}, this version needs {_native.NATIVE_ABI}) at {module.__file__};"
                      " rebuild it with `pip install .` or `python setup.py build_ext --inplace`")
    if not stats.NATIVE_KERNEL:
        return None, "off: disabled by LIGHTNING_HOOKS_NATIVE=0 (the tensor-op kernel gives the same figures)"
    return module, f"on ({module.__file__})"


def avx2(module: Optional[ModuleType]) -> str:
    """Whether the native kernel runs its AVX2 passes."""
    if module is None:
        return "n/a (no native kernel)"
    current = module.set_avx2(True)  # set_avx2 returns the setting it replaces: so read it, then restore it
    supported = module.set_avx2(current)
    if current:
        return "on"
    return "off (switched off)" if supported else "off (this CPU or build has none: the SSE2/NEON passes run)"


def checksum() -> str:
    """How FastTensorBoardLogger checksums its event records: in C (with SSE4.2 or tables), or with numpy."""
    from lightning_hooks.output import _crc32c

    native = _crc32c.native
    if native is None:
        return ("numpy (the C extension was not built: about 4 ns a byte, 40x the C one's time; reinstall where a"
                " C compiler is found)")
    current = native.set_sse42(True)  # set_sse42 returns the setting it replaces: so read it, then restore it
    supported = native.set_sse42(current)
    if current:
        return "C (the SSE4.2 crc32 instruction)"
    return "C (tables: SSE4.2 switched off)" if supported else "C (tables: this CPU or build has no SSE4.2)"


def report() -> str:
    """The report, one ``name  value`` line per item."""
    module, native = native_kernel()
    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "no GPU"
    rows = [
        ("lightning_hooks", lightning_hooks.__version__),
        ("python", f"{platform.python_version()} ({platform.python_implementation()}, {platform.system()}"
                   f" {platform.machine()})"),
        ("torch", f"{torch.__version__} ({cuda})"),
        *((name, _version(distribution)) for name, distribution in _DISTRIBUTIONS.items()),
        ("native C kernel", native),
        ("AVX2", avx2(module)),
        ("FastTensorBoardLogger checksum", checksum()),
        ("torch threads", f"{torch.get_num_threads()} (the native kernel splits a large tensor over at most 16)"),
    ]
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join(f"{name:<{width}}{value}" for name, value in rows)


def main(argv: Optional[list[str]] = None) -> int:
    """Print the report; ``--help`` says what it is, and an unknown argument fails with a usage line."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_hooks",
        description="Print a report of this environment: the versions of lightning_hooks, Python, torch and"
                    " the Lightning packages, whether the native statistics kernel is on (and if not, why),"
                    " whether it uses AVX2, how FastTensorBoardLogger checksums its records, and how many"
                    " threads torch uses. Paste it into an issue, or read it when statistics are slow.",
    )
    parser.parse_args(argv)
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
