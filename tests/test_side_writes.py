"""A side write that fails (a full disk, a read-only mount) warns and is survived; a bad ``dirpath`` fails in setup.

The disks are real: tmpfs mounts, full or read-only (root can write anywhere a permission bit
forbids, so a ``chmod`` proves nothing). Without root, or where mounting is not allowed, these
tests are skipped.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_hooks import GradientAnomalyStopping
from tests.grad_helpers import GradNet
from tests.helpers import events, loader, trainer


def _mount(path: Path, options: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs filled to the last byte."""
    for path in _mount(tmp_path / "full", "size=256k"):
        with open(path / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 4096)
        yield path


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs."""
    yield from _mount(tmp_path / "ro", "ro,size=64k")


def test_a_full_dirpath_at_the_anomaly_warns_keeps_the_report_in_the_loggers_and_still_stops(tmp_path, full_disk):
    stopper = GradientAnomalyStopping(action="stop", dirpath=full_disk / "anomalies", prog_bar=False)
    fit = trainer(tmp_path, [stopper], max_steps=8, logger=TensorBoardLogger(str(tmp_path), name="tb"))
    saved = r"step 3 could not be saved to .*anomaly-step3-rank0.pt \((OSError|RuntimeError)"  # torch.save: either
    with pytest.warns(UserWarning, match=saved):
        fit.fit(GradNet(nan_steps=[3]), loader())
    report = stopper.last_report
    assert report is not None and report.step == 3 and report.saved_path is None
    assert fit.global_step == 4 and stopper.dropped_steps == 1  # stopped at the anomaly, its update dropped
    (text,) = events(str(tmp_path / "tb")).Tensors("anomalies/report/text_summary")
    assert "Gradient anomaly at step 3" in text.tensor_proto.string_val[0].decode()
    assert os.listdir(full_disk / "anomalies") == []  # no partial file left behind


def test_a_full_log_dir_loses_the_flight_record_csv_only_and_the_run_stops_as_asked(tmp_path, full_disk):
    stopper = GradientAnomalyStopping(action="stop", flight_recorder=8, prog_bar=False)
    fit = trainer(full_disk, [stopper], max_steps=8, logger=False)
    with pytest.warns(UserWarning, match=r"flight record of step 3 could not be written to .*step3.csv \(OSError"):
        fit.fit(GradNet(nan_steps=[3]), loader())
    record = stopper.last_report.flight_record
    assert record is not None and record.path is None and record.steps == (0, 1, 2, 3)
    assert fit.global_step == 5 and fit.should_stop  # step 3 read at step 4 (act_late), whose update is dropped
    assert sorted(os.listdir(full_disk)) == ["filler"]


def test_a_read_only_dirpath_fails_in_setup_before_any_step(tmp_path, read_only):
    model = GradNet(nan_steps=[3])
    stopper = GradientAnomalyStopping(action="stop", dirpath=read_only / "anomalies", prog_bar=False)
    fit = trainer(tmp_path, [stopper], max_steps=8, logger=False)
    with pytest.raises(ValueError, match=r"`dirpath`=.*anomalies' cannot be written \(OSError: Read-only file system"):
        fit.fit(model, loader())
    assert fit.global_step == 0


def test_without_a_logger_the_flight_record_goes_under_default_root_dir_not_the_working_directory(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "root"
    stopper = GradientAnomalyStopping(action="skip", flight_recorder=8, prog_bar=False)
    trainer(root, [stopper], max_steps=6, logger=False).fit(GradNet(nan_steps=[3]), loader())
    path = Path(stopper.last_report.flight_record.path)
    assert path.parent == root and path.name == "flight-record-step3.csv" and path.is_file()
    assert not list(tmp_path.glob("flight-record-*"))
