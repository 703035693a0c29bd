"""A TensorBoardLogger whose event file the package writes: the same file, each record's checksum in C.

TensorBoard frames every record of an event file with a CRC-32C computed one Python loop
iteration per byte (without TensorFlow), holding the GIL on its writer thread: 0.1-0.6 s per MB,
and a logged step of a thousand modules' histograms is several MB. Lightning's
``TensorBoardLogger`` writes through it, and the package leaves the user's writer as it is.
:class:`FastTensorBoardLogger` is Lightning's logger with one difference: its ``SummaryWriter``
writes to an event file the package owns (:class:`~lightning_hooks.output._event_file.EventFile`),
the same records framed with the C checksum. One file per run, as Lightning's logger makes:
TensorBoard reads it live with any loader (two files appended at once in one run directory are
not: TensorBoard's Python loader polls only the last, see ``docs/cost.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.writer import FileWriter

from lightning_hooks.core._torch_internals import event_queue
from lightning_hooks.output._event_file import EventFile


class FastTensorBoardLogger(TensorBoardLogger):
    """Lightning's ``TensorBoardLogger``, its event file written with a C checksum: logged steps cost less.

    Takes Lightning's arguments and writes the same directory and the same records (the Layers
    tab, TensorBoard's tabs and ``EventAccumulator`` read them as they read Lightning's), from
    every writer: the package's figures, ``self.log`` and ``logger.experiment.add_*``. Where the
    log dir is not local (``s3://``, ``gs://``: written through TensorBoard's own file system
    layer) it is Lightning's logger, unchanged.

    Example::

        import lightning as L
        from lightning_hooks import ActivationMonitor, FastTensorBoardLogger

        trainer = L.Trainer(logger=FastTensorBoardLogger("lightning_logs"), callbacks=[ActivationMonitor()])
    """

    @property
    @rank_zero_experiment
    def experiment(self) -> SummaryWriter:
        """The run's ``SummaryWriter`` (made at first use, rank zero only), over the package's event file."""
        if self._experiment is not None or "://" in str(self.log_dir):
            return super().experiment
        if self.root_dir:
            self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = FastSummaryWriter(log_dir=self.log_dir, **self._kwargs)
        return self._experiment


class FastSummaryWriter(SummaryWriter):
    """torch's ``SummaryWriter`` over :class:`FastFileWriter`: every ``add_*`` method as torch's, the file ours.

    :meth:`write_event_bytes` takes an ``Event``'s wire bytes as they are. ``_get_file_writer`` is
    torch's own (private) factory of the writer's ``FileWriter``, overridden here on the package's
    own class; ``tests/test_fast_tensorboard.py`` fails if torch stops calling it (a second file).
    """

    def _get_file_writer(self) -> FileWriter:
        """The file writer, a new one after ``close()`` (torch's ``_get_file_writer``, over our file)."""
        if self.all_writers is None or self.file_writer is None:
            writer = FastFileWriter(self.log_dir, self.max_queue, self.flush_secs, self.filename_suffix)
            self.file_writer, self.all_writers = writer, {writer.get_logdir(): writer}  # type: ignore[assignment]
            if self.purge_step is not None:  # as torch's: a restart at this step hides what came after it
                writer.add_event(Event(step=self.purge_step, file_version="brain.Event:2"))
                writer.add_event(Event(step=self.purge_step, session_log=SessionLog(status=SessionLog.START)))
                self.purge_step = None
        return self.file_writer  # type: ignore[return-value]

    def write_event_bytes(self, event: bytes) -> None:
        """Write an ``Event`` given as its wire bytes (reopening the file after ``close()``, as ``add_*`` do)."""
        self._get_file_writer().event_writer.write(event)


class FastFileWriter(FileWriter):
    """torch's ``FileWriter`` over an :class:`~lightning_hooks.output._event_file.EventFile`: its methods as torch's."""

    def __init__(self, log_dir: Any, max_queue: int = 10, flush_secs: int = 120, filename_suffix: str = "") -> None:
        self.event_writer: EventFile = EventFile(log_dir, max_queue, flush_secs, filename_suffix)  # type: ignore[assignment]

    @property
    def path(self) -> Optional[str]:
        """The event file's path."""
        return self.event_writer.path


def event_queue_of(logger: Logger) -> Optional[Callable[[bytes], None]]:
    """Where a whole event's bytes can go at once (the fast path), or None: then the writer's public methods.

    The package's own writer (:class:`~lightning_hooks.output.fast_tensorboard.FastTensorBoardLogger`)
    has a public one; torch's ``SummaryWriter`` over TensorBoard's own ``EventFileWriter`` has
    one (see :func:`~lightning_hooks.core._torch_internals.event_queue`); tensorboardX's writer
    (other protos), a writer of another kind, or a TensorBoard whose internals moved get None.
    """
    writer = logger.experiment
    if isinstance(writer, FastSummaryWriter):
        return writer.write_event_bytes
    return event_queue(writer) if isinstance(writer, SummaryWriter) else None
