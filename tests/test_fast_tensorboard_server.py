"""What a user sees of FastTensorBoardLogger's run, live, in a real ``tensorboard`` server; and why it is one file.

TensorBoard's Python loader (``--load_fast=false``, and what ``auto`` falls back to wherever its
Rust data server has no binary: Windows, Apple Silicon, Linux on ARM; or for log dirs neither
local nor ``gs://``) polls only the last event file of a run directory while
``--reload_multifile`` is off, its default: of two files appended at the same time, only the
one whose name sorts last is read live. The first test shows it on the installed TensorBoard
(if it ever fails, that constraint is gone); the package therefore writes no second file beside
the user's, and FastTensorBoardLogger makes the run's one file.
"""

import json
import sys
import time
import urllib.error
import urllib.parse
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback
from torch.utils.tensorboard import SummaryWriter

from lightning_hooks import ActivationMonitor, FastTensorBoardLogger, GradientMonitor
from tests.helpers import loader, trainer
from tests.test_fast_tensorboard import Logs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from layers_tab import tensorboard, wait_for_run  # noqa: E402

pytestmark = pytest.mark.slow  # each starts a real TensorBoard server


def _steps(base, run, tag):
    """The steps of scalar ``tag`` of ``run`` the server at ``base`` has read (none before it has)."""
    query = urllib.parse.urlencode({"run": run, "tag": tag})
    try:
        with urllib.request.urlopen(f"{base}/data/plugin/scalars/scalars?{query}", timeout=30) as response:
            return [step for _, step, _ in json.loads(response.read())]
    except (urllib.error.URLError, ConnectionError):
        return []


def _until(check, timeout):
    """Poll ``check`` until it is true or ``timeout`` seconds passed; its last answer."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.3)
    return check()


@pytest.mark.parametrize(("load_fast", "flags", "older_file_live"), [
    ("false", [], False),  # the Python loader, as it comes
    ("false", ["--reload_multifile=true"], True),
    ("true", [], True),  # the Rust data server
], ids=["python loader", "python loader, reload_multifile", "rust data server"])
def test_of_two_event_files_appended_at_once_the_python_loader_reads_only_the_last(
        tmp_path, load_fast, flags, older_file_live):
    older = SummaryWriter(tmp_path / "run")
    time.sleep(1.1)  # the file name starts with the time in seconds: the newer one sorts last
    newer = SummaryWriter(tmp_path / "run")
    for writer, tag in ((older, "older"), (newer, "newer")):
        writer.add_scalar(tag, 0.0, 0)
        writer.flush()
    with tensorboard(tmp_path, tmp_path / "tb.log", load_fast=load_fast, flags=flags) as base:
        assert _until(lambda: _steps(base, "run", "older") == [0] == _steps(base, "run", "newer"), 60)
        for step in (1, 2):  # training goes on: both files are appended
            for writer, tag in ((older, "older"), (newer, "newer")):
                writer.add_scalar(tag, float(step), step)
                writer.flush()
        assert _until(lambda: _steps(base, "run", "newer") == [0, 1, 2], 60)
        live = _until(lambda: _steps(base, "run", "older") == [0, 1, 2], 8)  # 8 reloads at least
    older.close()
    newer.close()
    assert live == older_file_live


class WaitForTensorBoard(Callback):
    """At the start of step ``at``, while the fit goes on, wait until the server shows every step before it."""

    def __init__(self, base, run, at):
        self.base, self.run, self.at, self.seen = base, run, at, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.at:
            return
        want = list(range(self.at))
        for tag in ("loss", "gradients/net.0.weight/norm", "activations/net.0/mean"):
            self.seen[tag] = _until(lambda tag=tag: _steps(self.base, self.run, tag) == want, 60) and want
        tab = wait_for_run(self.base, self.run, self.at, timeout=60)  # the Layers tab, through the data provider
        self.seen["layers tab"] = max(len(figure["steps"]) for figure in tab["figures"])


@pytest.mark.parametrize("load_fast", ["false", "true"], ids=["python loader", "rust data server"])
def test_a_live_run_of_the_fast_logger_is_read_as_it_trains_by_every_loader_and_the_layers_tab(tmp_path, load_fast):
    logger = FastTensorBoardLogger(tmp_path / "logs", name="fast", version=0)
    with tensorboard(tmp_path / "logs", tmp_path / "tb.log", load_fast=load_fast) as base:
        waits = WaitForTensorBoard(base, "fast/version_0", at=4)
        callbacks = [ActivationMonitor(), GradientMonitor(stats=("norm", "max")), waits]
        trainer(tmp_path, callbacks, logger=logger).fit(Logs(), loader())
    assert waits.seen == {"loss": [0, 1, 2, 3], "gradients/net.0.weight/norm": [0, 1, 2, 3],
                          "activations/net.0/mean": [0, 1, 2, 3], "layers tab": 4}
