"""A capture writer on its own thread: the sidecar's event loop hands records over through a
bounded queue and never waits on the disk (a write, a segment rotation, an fsync).

When the disk falls behind and the queue is full, a record is dropped and counted
(``queue_dropped``), never waited for: the proxy's traffic must not slow down to the disk's
pace. Meta changes are rare and go straight to the writer (it is thread-safe).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from ..model import KINDS
from .writer import CaptureWriter, kind_of

log = logging.getLogger(__name__)

QUEUE_RECORDS_DEFAULT = 50_000
_STOP = object()


class QueuedWriter:
    """``write`` enqueues; a thread writes. Everything else is the wrapped CaptureWriter's."""

    def __init__(self, writer: CaptureWriter, max_queue: int = QUEUE_RECORDS_DEFAULT,
                 on_drop: Callable[[str, int], None] | None = None):
        self.writer = writer
        self.on_drop = on_drop
        self.queue_dropped: dict[str, int] = {k: 0 for k in KINDS}
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="kvdoctor-writer", daemon=True)
        self._thread.start()

    def __getattr__(self, name: str) -> Any:  # meta, counts, dropped, update_meta, source_status, ...
        return getattr(self.writer, name)

    def write(self, record: Any) -> None:
        try:
            self._q.put_nowait(record)
        except queue.Full:
            kind = kind_of(record)
            self.queue_dropped[kind] += 1
            if not self._warned:
                self._warned = True
                log.warning("capture: the disk is falling behind; records are dropped and counted")
            if self.on_drop:
                self.on_drop(kind, 1)

    def _run(self) -> None:
        w = self.writer
        while True:
            record = self._q.get()
            try:
                if record is _STOP:
                    return
                kind = kind_of(record)
                before = w.dropped[kind]
                w.write(record)
                if self.on_drop and w.dropped[kind] != before:
                    self.on_drop(kind, w.dropped[kind] - before)
            except Exception:  # noqa: BLE001 - one bad record must not end the writer thread
                log.exception("capture: a record could not be written")
            finally:
                self._q.task_done()

    def flush(self) -> None:
        """Wait until every queued record is written, then fsync."""
        if self._thread.is_alive():
            self._q.join()
        self.writer.flush()

    def close(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            try:
                self._q.put(_STOP, timeout=timeout_s)  # after every record already queued
            except queue.Full:
                log.warning("capture: the writer thread is stuck; closing without the queued records")
            self._thread.join(timeout_s)
        self.writer.close()
