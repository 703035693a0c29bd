"""What the tests of a real TensorBoard server and headless Chromium share.

The server, Chromium and the synthetic run are driven by ``benchmarks/layers_tab.py`` (the Layers
tab's benchmark); its helpers are imported from here, with a skip mark for a machine without Chromium.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from layers_tab import (  # noqa: E402
    DEAD,
    PLUGIN,
    browse,
    chromium,
    devtools,
    get,
    tab_url,
    tensorboard,
    wait_for,
    wait_for_run,
    write_synthetic_run,
)

__all__ = ["DEAD", "PLUGIN", "browse", "devtools", "get", "needs_chromium", "tab_url", "tensorboard", "wait_for",
           "wait_for_run", "write_synthetic_run"]

needs_chromium = pytest.mark.skipif(chromium() is None, reason="chromium is not installed (apt-get install chromium)")
