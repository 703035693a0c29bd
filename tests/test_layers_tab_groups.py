"""Which member a collapsed group of the Layers tab is drawn by, run in headless Chromium (``static/rows.js``)."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.browser import devtools, needs_chromium

STATIC = Path(__file__).resolve().parent.parent / "lightning_hooks" / "tensorboard_plugin" / "static"

# Two members at different scales (an attention's input projection and its output, x5 apart), 1% noise each, drawn
# by the tab's log colour scale; then the output member x150 at the last 5 steps; then one member marked, one NaN.
PAGE = """<!doctype html><body><script type="module">
import {drawnMember} from "./rows.js";
const steps = 60, rng = (i) => Math.sin(i * 12.9898) * 0.01;
const qkv = Array.from({length: steps}, (_, i) => 1.0 * (1 + rng(i)));
const out = Array.from({length: steps}, (_, i) => 5.0 * (1 + rng(i + 1000)));
const scale = {at: (v) => (Math.log(v) - Math.log(0.1)) / (Math.log(1000) - Math.log(0.1))};
const row = {members: [0, 1]};
function drawn(values, marks = new Map()) {
  const view = {values, scale, marks, markedRows: new Set([...marks.keys()].map((k) => Number(k.split(",")[0])))};
  return Array.from({length: steps}, (_, c) => drawnMember(view, row, c));
}
const blown = out.map((v, i) => i >= steps - 5 ? v * 150 : v);
const nan = qkv.map((v, i) => i === 30 ? NaN : v);
document.body.dataset.result = JSON.stringify({
  healthy: drawn([qkv, out]), blown: drawn([qkv, blown]).slice(steps - 5),
  marked: drawn([qkv, out], new Map([["1,20", "blowup"]]))[20], nan: drawn([out, nan])[30]});
document.body.dataset.ready = "true";
</script></body>"""


@contextmanager
def served(root: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@needs_chromium
def test_a_healthy_group_is_drawn_by_one_member_and_an_abnormal_member_takes_its_cells(tmp_path):
    """A healthy group of two members at different scales is drawn by its first member at every step (it was drawn
    by whichever member's noise was the larger there: the collapsed row striped, two scales apart, on a healthy
    GPT-NeoX's attention groups); a member 150x its own usual is drawn at its steps, and a marked or non-finite
    member at its cell."""
    shutil.copy(STATIC / "rows.js", tmp_path / "rows.js")
    (tmp_path / "index.html").write_text(PAGE)
    with served(tmp_path) as base, devtools(f"{base}/index.html") as tools:
        result = json.loads(tools.evaluate("document.body.dataset.result"))
    assert set(result["healthy"]) == {0}, result["healthy"]
    assert result["blown"] == [1] * 5, result["blown"]
    assert result["marked"] == 1 and result["nan"] == 1, result
