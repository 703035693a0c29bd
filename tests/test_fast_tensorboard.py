"""FastTensorBoardLogger: the same figures in one event file the package owns, framed with its own CRC-32C.

Read back by TensorBoard's own loader (``EventAccumulator``) and checked record by record
against TensorBoard's checksum; with the C checksum and with its numpy fallback; the file
closed and its thread gone after ``fit``, an exception's included.
"""

import glob
import os
import struct
import threading

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c, masked_crc32c

from lightning_hooks import ActivationMonitor, FastTensorBoardLogger, GradientMonitor
from lightning_hooks.output import _crc32c
from lightning_hooks.output._event_file import EventFile
from tests.helpers import TinyNet, events, loader, trainer


@pytest.fixture(params=["c, sse4.2", "c, tables", "numpy"])
def checksum(request, monkeypatch):
    """Each test that takes this runs with the C checksum (with and without SSE4.2) and with numpy's."""
    if request.param == "numpy":
        monkeypatch.setattr(_crc32c, "native", None)
    elif _crc32c.native is None:
        pytest.skip("the C checksum was not built")
    else:
        before = _crc32c.native.set_sse42(request.param == "c, sse4.2")
        request.addfinalizer(lambda: _crc32c.native.set_sse42(before))
        if request.param == "c, sse4.2" and not _crc32c.native.set_sse42(True):
            pytest.skip("this CPU has no SSE4.2")
    return request.param


def test_the_record_checksum_is_tensorboards_bit_for_bit(checksum):
    rng = np.random.default_rng(1)
    # Around the chunking's, padding's and 8-byte words' edges, and where the C code releases the GIL.
    for size in [*range(20), 4095, 4096, 4097, 5003, 65535, 65536, 70001, 300000]:
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert _crc32c.masked(data) == masked_crc32c(data), size
        assert _crc32c.crc32c(data) == crc32c(data), size
    data = rng.integers(0, 256, 1001, dtype=np.uint8).tobytes()
    assert _crc32c.crc32c(memoryview(data)[1:]) == crc32c(data[1:])  # an unaligned start


def test_the_c_checksum_is_built_where_required():
    # CI sets LIGHTNING_HOOKS_REQUIRE_NATIVE=1: a failed build must not pass as the slow path.
    if os.environ.get("LIGHTNING_HOOKS_REQUIRE_NATIVE") != "1":
        pytest.skip("set LIGHTNING_HOOKS_REQUIRE_NATIVE=1 to require the C extensions")
    assert _crc32c.native is not None


def test_the_c_checksum_refuses_what_is_not_bytes():
    if _crc32c.native is None:
        pytest.skip("the C checksum was not built")
    with pytest.raises(TypeError, match="must be a contiguous bytes-like object.*got str"):
        _crc32c.native.crc32c("text")


def records(path):
    """Every record of the event file at ``path``, each checked against TensorBoard's own masked CRC-32C."""
    data, found = open(path, "rb").read(), []
    while data:
        (size,), header_crc = struct.unpack("<Q", data[:8]), struct.unpack("<I", data[8:12])[0]
        record, crc = data[12 : 12 + size], struct.unpack("<I", data[12 + size : 16 + size])[0]
        assert (header_crc, crc) == (int(masked_crc32c(data[:8])), int(masked_crc32c(record)))
        data, found = data[16 + size :], [*found, record]
    return found


class Logs(TinyNet):
    """TinyNet that logs its loss with ``self.log``, and raises at ``fail_at`` (a step) if given."""

    def __init__(self, fail_at=None):
        super().__init__()
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("the user's step failed")
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


def _fit(tmp_path, logger, fail_at=None):
    torch.manual_seed(0)
    callbacks = [ActivationMonitor(), GradientMonitor(stats=("norm", "max"))]
    trainer(tmp_path, callbacks, logger=logger).fit(Logs(fail_at), loader())


def _open_files():
    """The paths this process has open (Linux), or None where /proc cannot say."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    return {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}


def _writer_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("lightning_hooks events.out.tfevents")]


def test_the_same_figures_as_lightnings_logger_in_one_file_whose_every_record_checks_out(tmp_path, checksum):
    plain = TensorBoardLogger(tmp_path, name="plain", version=0)
    fast = FastTensorBoardLogger(tmp_path, name="fast", version=0)
    values = np.random.default_rng(0).standard_normal(10_000)
    for logger in (plain, fast):  # the user's own writes, one of a record where the numpy and C code paths run
        logger.experiment.add_histogram("user/big", values, 0, bins=1000)
        _fit(tmp_path / logger.name, logger)

    (path,) = glob.glob(f"{fast.log_dir}/events.out.tfevents.*")
    assert Event.FromString(records(path)[0]).file_version == "brain.Event:2"
    assert max(len(r) for r in records(path)) > 4096
    want, got = events(plain.log_dir), events(fast.log_dir)
    assert got.Tags()["scalars"] == want.Tags()["scalars"] and "loss" in got.Tags()["scalars"]
    assert got.Tags()["histograms"] == want.Tags()["histograms"]
    big = [(h.step, tuple(h.histogram_value.bucket)) for h in got.Histograms("user/big")]
    assert big == [(h.step, tuple(h.histogram_value.bucket)) for h in want.Histograms("user/big")]
    for tag in ("loss", "gradients/net.0.weight/norm", "activations/net.0/mean"):
        assert [(s.step, s.value) for s in got.Scalars(tag)] == [(s.step, s.value) for s in want.Scalars(tag)]
    hist = [(h.step, tuple(h.histogram_value.bucket)) for h in got.Histograms("activations/net.0")]
    assert len(hist) == 6 and hist == [(h.step, tuple(h.histogram_value.bucket))
                                       for h in want.Histograms("activations/net.0")]
    assert "layers/forward_order" in got.PluginTagToContent("lightning_hooks_layers")


@pytest.mark.parametrize("fail_at", [None, 3], ids=["fit ends", "the step raises"])
def test_no_file_is_left_open_and_no_thread_left_running_after_fit(tmp_path, fail_at):
    logger = FastTensorBoardLogger(tmp_path, name="", version=0)
    if fail_at is None:
        _fit(tmp_path, logger)
    else:
        with pytest.raises(RuntimeError, match="the user's step failed"):
            _fit(tmp_path, logger, fail_at)

    (path,) = glob.glob(f"{logger.log_dir}/events.out.tfevents.*")
    assert _writer_threads() == []
    opened = _open_files()
    assert opened is None or os.path.realpath(path) not in opened
    steps = [s.step for s in events(logger.log_dir).Scalars("gradients/net.0.weight/norm")]
    assert steps == list(range(6 if fail_at is None else fail_at))  # every step before the raise is in


def test_the_package_writes_through_the_loggers_public_bytes_method_and_writing_after_close_reopens(tmp_path):
    logger = FastTensorBoardLogger(tmp_path, name="", version=0)
    _fit(tmp_path, logger)
    logger.experiment.add_scalar("after", 1.0, 7)  # after finalize() closed it: a new file, as torch's writer does
    logger.experiment.close()

    assert len(glob.glob(f"{logger.log_dir}/events.out.tfevents.*")) == 2
    assert [s.step for s in events(logger.log_dir).Scalars("after")] == [7]


def test_the_event_file_hands_a_write_error_to_the_callers_thread(tmp_path):
    events_file = EventFile(tmp_path)
    events_file._file.close()  # the disk is gone under the writer thread
    events_file.write(b"\x10\x01")
    with pytest.raises(ValueError, match="closed file"):
        events_file.flush()
    events_file.close()
    assert _writer_threads() == []
    with pytest.raises(TypeError, match="expected an Event.*got bytes"):
        events_file.add_event(b"")


def test_purge_step_hides_what_a_resumed_run_writes_again_as_torchs_writer_does(tmp_path):
    first = FastTensorBoardLogger(tmp_path, name="", version=0)
    for step in range(6):
        first.experiment.add_scalar("x", float(step), step)
    first.finalize("success")
    resumed = FastTensorBoardLogger(tmp_path, name="", version=0, purge_step=3)  # torch's SummaryWriter argument
    for step in (3, 4):
        resumed.experiment.add_scalar("x", 10.0 + step, step)
    resumed.finalize("success")

    assert [(s.step, s.value) for s in events(first.log_dir).Scalars("x")] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
