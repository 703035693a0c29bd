"""An event file the package owns: TensorBoard's record format, each record's CRC-32C in C, written by a thread.

It has the methods of TensorBoard's ``EventFileWriter`` that torch's ``FileWriter`` calls
(``add_event``, ``flush``, ``close``, ``reopen``, ``get_logdir``), and :meth:`EventFile.write`,
which takes an ``Event``'s wire bytes as they are (the package lays a logged step's events out
as bytes). Records are framed as TensorBoard's ``RecordWriter`` frames them: the length (8 bytes,
little-endian), its masked CRC-32C, the data, the data's masked CRC-32C (:mod:`._crc32c`).
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
import time
from typing import Optional, Union

from tensorboard.compat.proto.event_pb2 import Event

from lightning_hooks.output._crc32c import masked

_FLUSH, _STOP = object(), object()  # what the writer thread is told besides records
_NUMBERS = itertools.count()  # file names of one process differ by this


def frame(data: bytes) -> bytes:
    """One record of an event file: ``data``'s length and its masked CRC-32C, ``data``, its masked CRC-32C."""
    header = len(data).to_bytes(8, "little")
    return b"".join((header, masked(header).to_bytes(4, "little"), data, masked(data).to_bytes(4, "little")))


class EventFile:
    """A new event file in ``log_dir``, written by a thread of its own, as TensorBoard's ``EventFileWriter`` is.

    Named as TensorBoard names its files (``events.out.tfevents.<time>.<host>.<pid>.<n><suffix>``,
    ``n`` is ``lh`` and a number, so that no TensorBoard writer of this process picks the same
    name); its first record says the file's version, as TensorBoard's does. Records queue up to
    ``max_queue`` (then :meth:`write` waits); the file is flushed whenever the queue runs dry (so
    a live TensorBoard sees each logged step), and at least every ``flush_secs`` while records
    keep coming.

    Args:
        log_dir: A local directory (made if missing).
        max_queue: Records waiting at most.
        flush_secs: Seconds between flushes at most, while records come.
        filename_suffix: Added to the file's name.

    Example::

        events = EventFile("lightning_logs/version_0")
        events.add_event(Event(step=1, wall_time=time.time()))
        events.close()
    """

    def __init__(self, log_dir: Union[str, os.PathLike], max_queue: int = 10, flush_secs: float = 120,
                 filename_suffix: str = "") -> None:
        self._log_dir, self._max_queue, self._flush_secs = str(log_dir), max_queue, flush_secs
        self._suffix = filename_suffix
        self._open()

    def _open(self) -> None:
        os.makedirs(self._log_dir, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
                f".lh{next(_NUMBERS)}{self._suffix}")
        self.path = os.path.join(self._log_dir, name)
        self._file = open(self.path, "xb")  # noqa: SIM115 - closed by the thread, on close()
        self._queue: queue.Queue[object] = queue.Queue(max(1, self._max_queue))
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"lightning_hooks {name}", daemon=True)
        self._thread.start()
        self.add_event(Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def get_logdir(self) -> str:
        """The directory the file is in."""
        return self._log_dir

    def add_event(self, event: Event) -> None:
        """Queue ``event`` to be written.

        Raises:
            TypeError: ``event`` is not an ``Event``.
        """
        if not isinstance(event, Event):
            raise TypeError(f"expected an Event (tensorboard.compat.proto.event_pb2), got {type(event).__name__}")
        self.write(event.SerializeToString())

    def write(self, data: bytes) -> None:
        """Queue an ``Event``'s wire bytes to be framed and written; nothing after :meth:`close`.

        Raises:
            OSError: An earlier write failed (the disk is full, the file was removed): the error
                is raised here, on the caller's thread.
        """
        self._raise_error()
        if not self._closed:
            self._queue.put(data)

    def flush(self) -> None:
        """Write every queued record and flush the file."""
        if not self._closed:
            self._queue.put(_FLUSH)
            self._queue.join()
        self._raise_error()

    def close(self) -> None:
        """Write every queued record and close the file; again, nothing."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_error()

    def reopen(self) -> None:
        """After :meth:`close`, a new file in the same directory (as TensorBoard's writer does); else nothing."""
        if self._closed:
            self._open()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        """The writer thread: frame and write records, flush when the queue runs dry or a flush is due."""
        due = time.monotonic() + self._flush_secs
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    self._file.close()
                    return
                if item is not _FLUSH:
                    self._file.write(frame(item))  # type: ignore[arg-type]
                if item is _FLUSH or self._queue.empty() or time.monotonic() >= due:
                    self._file.flush()
                    due = time.monotonic() + self._flush_secs
            except Exception as error:  # noqa: BLE001 - handed to the caller's thread
                self._error = error
            finally:
                self._queue.task_done()
