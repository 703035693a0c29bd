"""TensorBoard through its public methods: the fast path is an optimisation, never a requirement.

The fast path hands a step's whole event to TensorBoard's writer thread as bytes, through names
TensorBoard keeps private. A writer where those names are missing (a TensorBoard release that
renamed them, or a writer of another kind) must get the very same figures through the public
methods, and no object of the user's writer may be changed along the way.
"""

import glob
import struct

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from torch.utils.tensorboard import SummaryWriter

from lightning_hooks import ActivationMonitor, GradientMonitor
from lightning_hooks.core._torch_internals import event_queue
from tests.helpers import TinyNet, events, loader, trainer


class PublicEvents:
    """TensorBoard's ``EventFileWriter`` as its public methods only: what a release renaming its internals leaves."""

    def __init__(self, inner):
        self.inner = inner

    def add_event(self, event):
        self.inner.add_event(event)

    def get_logdir(self):
        return self.inner.get_logdir()

    def flush(self):
        self.inner.flush()

    def close(self):
        self.inner.close()


class RenamedInternals(SummaryWriter):
    """torch's ``SummaryWriter`` whose event writer has only TensorBoard's public methods."""

    def _get_file_writer(self):
        file_writer = super()._get_file_writer()
        if not isinstance(file_writer.event_writer, PublicEvents):
            file_writer.event_writer = PublicEvents(file_writer.event_writer)
        return file_writer


class PublicMethods:
    """A writer that is no ``SummaryWriter``: only the public methods of one, nothing with an underscore."""

    def __init__(self, log_dir):
        self.writer = SummaryWriter(log_dir)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.writer, name)


class LoggerWith(TensorBoardLogger):
    """Lightning's TensorBoardLogger over a writer of the test's choosing."""

    def __init__(self, make_writer, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.make_writer = make_writer

    @property
    def experiment(self):
        if self._experiment is None:
            self._experiment = self.make_writer(self.log_dir)
        return self._experiment


def _fit(tmp_path, logger):
    torch.manual_seed(0)
    callbacks = [ActivationMonitor(), GradientMonitor(stats=("norm", "max"))]
    trainer(tmp_path, callbacks, logger=logger).fit(TinyNet(), loader())
    return events(logger.log_dir)


def _figures(acc):
    tags = acc.Tags()
    scalars = {t: [(s.step, s.value) for s in acc.Scalars(t)] for t in tags["scalars"]
               if t.startswith(("activations/", "gradients/", "anomalies/"))}
    histograms = {t: [(h.step, h.histogram_value.num, h.histogram_value.min, h.histogram_value.max,
                       tuple(h.histogram_value.bucket)) for h in acc.Histograms(t)] for t in tags["histograms"]}
    layout = acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0]
    return scalars, histograms, layout


def _text_tags(acc):
    try:
        return acc.PluginTagToContent("text")
    except KeyError:  # no text at all
        return {}


@pytest.mark.parametrize("make_writer", [RenamedInternals, PublicMethods], ids=["renamed internals", "public only"])
def test_a_writer_without_the_private_names_gets_the_same_figures_through_its_public_methods(tmp_path, make_writer):
    fast = TensorBoardLogger(tmp_path / "fast", name="", version=0)
    public = LoggerWith(make_writer, tmp_path / "public", name="", version=0)
    assert event_queue(fast.experiment) is not None and event_queue(public.experiment) is None

    want, got = _figures(_fit(tmp_path / "fast", fast)), _figures(_fit(tmp_path / "public", public))

    assert got == want
    scalars, histograms, layout = got
    for acc in (events(fast.log_dir), events(public.log_dir)):  # the Layers tab's data, not the Text tab's
        assert "layers/forward_order" in acc.PluginTagToContent("lightning_hooks_layers")
        assert "layers/forward_order" not in _text_tags(acc)
    assert len(scalars["gradients/net.0.weight/norm"]) == 6 and len(histograms["activations/net.0"]) == 6
    assert b"activations" in layout


def test_no_object_of_the_users_writer_changes_class_and_every_record_checks_out(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="", version=0)
    file_writer = logger.experiment._get_file_writer()
    chain = [logger.experiment, file_writer, file_writer.event_writer, file_writer.event_writer._async_writer,
             file_writer.event_writer._async_writer._writer]
    before = [type(part) for part in chain]

    _fit(tmp_path, logger)

    assert [type(part) for part in chain] == before
    (path,) = glob.glob(f"{logger.log_dir}/events.out.tfevents.*")
    data, records = open(path, "rb").read(), 0
    while data:  # every record framed as TensorBoard frames it, with its checksums
        (size,), header_crc = struct.unpack("<Q", data[:8]), struct.unpack("<I", data[8:12])[0]
        record, crc = data[12 : 12 + size], struct.unpack("<I", data[12 + size : 16 + size])[0]
        assert (header_crc, crc) == (masked_crc32c(data[:8]), masked_crc32c(record))
        data, records = data[16 + size :], records + 1
    assert records > 6
