"""The Layers tab's load and render time on a synthetic 200-module run, through a real TensorBoard and Chromium.

Writes one run of 200 modules (a 16-block transformer's module names) x 300 logged steps with
the figures the monitors write (activation std, zero and non-finite fraction, gradient norm,
log10 update ratio: 300,000 scalars, and activation histograms every 10th step), starts the
installed ``tensorboard`` on it, times the plugin's ``run`` route, then opens the tab in
headless Chromium and reads the page's own timings (``performance.now()``, written to the DOM).

    python benchmarks/layers_tab.py [modules] [steps]

The helpers (a TensorBoard server, Chromium, the synthetic run) are used by tests/test_layers_tab.py.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

PLUGIN = "lightning_hooks_layers"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DEAD = "encoder.layers.7.mlp.act"


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``check`` until it returns something true; raise after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.3)
    raise TimeoutError(f"no {what} after {timeout} s")


@contextmanager
def tensorboard(logdir: Path, log: Path, load_fast: str = "false", flags: Sequence[str] = ()) -> Iterator[str]:
    """Run the installed ``tensorboard`` entry point over ``logdir`` on 127.0.0.1; yield its base URL.

    ``load_fast="false"`` reads the event files in Python (TensorBoard's multiplexer);
    ``"true"`` uses TensorBoard's Rust data server, the default where it is installed.
    ``flags`` are more of ``tensorboard``'s command-line flags.
    """
    _check_registered()
    script = Path(sys.executable).with_name("tensorboard")
    if not script.exists():
        raise FileNotFoundError(f"no `tensorboard` script next to {sys.executable}: install the package's venv")
    with open(log, "w+") as out:
        command = [str(script), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0",
                   f"--load_fast={load_fast}", "--reload_interval", "1", *flags]
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

        def address() -> Optional[str]:
            if proc.poll() is not None:
                raise RuntimeError(f"tensorboard exited: {log.read_text()}")
            found = re.search(r"http://127\.0\.0\.1:(\d+)/", log.read_text())
            return found and f"http://127.0.0.1:{found.group(1)}"

        try:
            yield wait_for(address, 60, "tensorboard address")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _check_registered() -> None:
    """Fail at once, saying how to fix it, when the installed package does not declare the plugin's entry point.

    Asked of an isolated interpreter (``-I``: no current directory on the path), as the
    ``tensorboard`` script sees it: a source tree's stale ``*.egg-info`` must not answer.
    """
    check = ("from importlib import metadata; found = metadata.entry_points(); "
             "group = found.select(group='tensorboard_plugins') if hasattr(found, 'select') "
             "else found.get('tensorboard_plugins', []); print(' '.join(entry.name for entry in group))")
    names = subprocess.run([sys.executable, "-I", "-c", check], capture_output=True, text=True, check=True,
                           cwd=tempfile.gettempdir()).stdout.split()
    if PLUGIN not in names:
        raise RuntimeError(f"TensorBoard cannot find the {PLUGIN!r} plugin: its entry point is declared at install"
                           " time; run `pip install -e .` (again) in this environment")


def get(base: str, route: str, **params: Any) -> Any:
    """The JSON the plugin's ``route`` answers (``urllib.error.HTTPError`` on an error status)."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{base}/data/plugin/{PLUGIN}/{route}{query}", timeout=60) as response:
        return json.loads(response.read())


def wait_for_run(base: str, run: str, steps: int, timeout: float = 120) -> dict[str, Any]:
    """The ``run`` route's answer once a figure of ``run`` has ``steps`` steps (loaded in the background)."""

    def check() -> Optional[dict[str, Any]]:
        try:
            found = get(base, "run", run=run)
        except (urllib.error.URLError, ConnectionError):
            return None
        return found if max((len(f["steps"]) for f in found["figures"]), default=0) >= steps else None

    return wait_for(check, timeout, f"run {run!r} with {steps} steps")


def chromium() -> Optional[str]:
    """Debian's ``chromium`` (or Chrome) if installed."""
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


@contextmanager
def _profile() -> Iterator[str]:
    """A fresh, empty Chromium profile folder, removed afterwards even if a helper process still writes to it."""
    folder = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def browse(url: str, *, screenshot: Optional[Path] = None, size: tuple[int, int] = (1200, 900),
           budget_ms: int = 20000) -> str:
    """Open ``url`` in headless Chromium; its DOM once the page settles (and a screenshot if asked)."""
    browser = chromium()
    if browser is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    with _profile() as profile:
        flags = [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
                 f"--window-size={size[0]},{size[1]}", "--hide-scrollbars"]
        if screenshot is not None:
            subprocess.run([browser, *flags, f"--screenshot={screenshot}", url], capture_output=True, timeout=120,
                           check=True)
        return subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120,
                              check=True).stdout


def page_timings(url: str, timeout: float = 120) -> dict[str, str]:
    """Open ``url`` in headless Chromium in real time and read the tab's timings from its ``<body>``.

    Chromium's ``--dump-dom`` needs virtual time, which stops the page's clock; this drives the
    browser over the DevTools protocol instead and polls ``document.body.dataset`` until the
    page says it is ready.
    """
    with devtools(url, timeout) as tools:
        return json.loads(tools.evaluate("JSON.stringify(document.body.dataset)"))


@contextmanager
def devtools(url: str, timeout: float = 120,
             page_ready: Optional[Callable[[DevTools], Any]] = None) -> Iterator[DevTools]:
    """Open ``url`` in headless Chromium (real time); yield its DevTools once the page is ready.

    Ready: the tab's page says so (``document.body.dataset.ready``), or ``page_ready(tools)`` is true
    (for TensorBoard's own page, where the tab is an iframe).
    """
    browser = chromium()
    if browser is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    with _profile() as profile:
        command = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                   "--remote-allow-origins=*", "--window-size=1400,1000", url]
        proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stderr = proc.stderr
            assert stderr is not None
            port = wait_for(lambda: re.search(r"ws://127\.0\.0\.1:(\d+)/", stderr.readline()), 30, "port")[1]
            pages = wait_for(lambda: [t for t in json.loads(urllib.request.urlopen(
                f"http://127.0.0.1:{port}/json/list").read()) if t["type"] == "page"], 30, "page")
            with DevTools(pages[0]["webSocketDebuggerUrl"]) as tools:
                ready = page_ready or (lambda t: t.evaluate("document.body && document.body.dataset.ready"))
                wait_for(lambda: ready(tools), timeout, "ready page")
                yield tools
        finally:  # the whole process group: Chromium's helpers outlive its main process
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


class DevTools:
    """The least of a WebSocket client that the DevTools protocol needs (no client library)."""

    def __init__(self, address: str) -> None:
        parts = urllib.parse.urlparse(address)
        self._sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self._sock.sendall((f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
                            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                            "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        self._file = self._sock.makefile("rb")
        while self._file.readline() not in (b"\r\n", b""):
            pass
        self._id = 0

    def __enter__(self) -> DevTools:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Call a DevTools protocol method; its result."""
        self._id += 1
        payload = json.dumps({"id": self._id, "method": method, "params": params}).encode()
        mask = os.urandom(4)
        size = bytes([0x80 | len(payload)]) if len(payload) < 126 else bytes([0xFE]) + struct.pack(">H", len(payload))
        self._sock.sendall(bytes([0x81]) + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        while True:
            answer = json.loads(self._frame())
            if answer.get("id") == self._id:
                if "error" in answer:
                    raise RuntimeError(f"DevTools {method}: {answer['error']}")
                return answer["result"]

    def _frame(self) -> bytes:
        head = self._file.read(2)
        size = head[1] & 0x7F
        if size >= 126:
            size = struct.unpack(">H" if size == 126 else ">Q", self._file.read(2 if size == 126 else 8))[0]
        return self._file.read(size)


def tab_url(base: str, **params: Any) -> str:
    """The Layers tab's own page (what TensorBoard puts in the tab's iframe), with deep-link parameters."""
    return f"{base}/data/plugin_entry.html?{urllib.parse.urlencode({'name': PLUGIN, **params})}"


def module_names(modules: int) -> list[str]:
    """``modules`` names of a transformer-like model, in forward order."""
    block = ["norm1", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "attn.dropout",
             "norm2", "mlp.fc1", "mlp.act", "mlp.fc2", "mlp.dropout", "residual"]
    names = ["embed"] + [f"encoder.layers.{i}.{part}" for i in range(modules) for part in block]
    return [*names[: modules - 1], "head"]


def write_synthetic_run(run_dir: Path, modules: int = 200, steps: int = 300) -> list[str]:
    """Write a run of ``modules`` x ``steps`` figures, as the monitors would, with ``DEAD`` dead; its module names."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import histogram_raw

    from lightning_hooks.output._plugin_data import FORWARD_ORDER_TAG, plugin_data_summary

    names = module_names(modules)
    writer = SummaryWriter(str(run_dir))
    events = writer._get_file_writer()
    events.add_summary(plugin_data_summary(FORWARD_ORDER_TAG, json.dumps(names)), 0)
    edges = [-(10.0 ** e) for e in range(2, -4, -1)] + [0.0] + [10.0 ** e for e in range(-3, 3)]
    for step in range(steps):
        values = []
        for i, name in enumerate(names):
            wave = 1 + 0.3 * math.sin(step / 20 + i)
            zeros = 0.95 if name == DEAD else 0.5 * wave * name.endswith("act")
            calm = 1 + 0.05 * math.sin(step / 20 + i)  # a std wave of +-30% is a blowup to the judge: DEAD only
            figures = {f"activations/{name}/std": calm, f"activations/{name}/nonfinite_fraction": 0.0,
                       f"activations/{name}/zero_fraction": zeros, f"gradients/{name}/norm": wave / (1 + step / 100),
                       f"updates/{name}/log10_ratio": -3 + 0.2 * wave}
            values += [Summary.Value(tag=tag, simple_value=v) for tag, v in figures.items()]
            if step % 10 == 0:
                counts = [0, 1, 5, 20, 50, 100, 100, 50, 20, 5, 1, 0]
                values += histogram_raw(f"activations/{name}", -1.0, 1.0, sum(counts), 0.0, 100.0, edges[1:],
                                        counts).value
        events.add_summary(Summary(value=values), step)
    writer.close()
    return names


def main(modules: int = 200, steps: int = 300, load_fast: str = "true") -> None:
    """Measure and print the route and render times for a synthetic run."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        for run in ("big", "first"):  # "first" is read once, uncached, after TensorBoard has loaded both
            write_synthetic_run(Path(tmp) / run, modules, steps)
        print(f"wrote 2 runs of {modules} modules x {steps} steps in {time.perf_counter() - started:.1f} s")
        with tensorboard(Path(tmp), Path(tmp) / "tensorboard.log", load_fast) as base:
            started = time.perf_counter()
            wait_for_run(base, "big", steps)
            print(f"tensorboard loaded the run in {time.perf_counter() - started:.1f} s")
            time.sleep(5)
            started = time.perf_counter()
            answer = get(base, "run", run="first")
            assert len(answer["figures"][0]["steps"]) == steps, "run 'first' was not loaded yet"
            print(f"run route, first read: {1000 * (time.perf_counter() - started):.0f} ms in all,"
                  f" {answer['server_ms']:.0f} ms in the plugin")
            for _ in range(3):
                started = time.perf_counter()
                answer = get(base, "run", run="big")
                total = 1000 * (time.perf_counter() - started)
                print(f"run route, unchanged run: {total:.0f} ms in all, {answer['server_ms']:.0f} ms in the plugin")
            if chromium() is not None:
                for _ in range(3):
                    timings = page_timings(tab_url(base))
                    print(f"browser: load {timings['loadMs']} ms (plugin {timings['serverMs']} ms),"
                          f" draw {timings['renderMs']} ms")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 200, int(args[1]) if args[1:] else 300, args[2] if args[2:] else "true")
