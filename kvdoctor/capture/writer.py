"""Append-only, crash-safe capture writer.

A capture is a folder: ``meta.json`` plus one stream of JSON Lines segments per record kind
(``requests-000001.jsonl``, ``gpu-000001.jsonl``, ...). Each record is one line written with a
single ``write`` on an unbuffered file, so a writer killed at any moment leaves every complete
line readable; at worst the last line of a segment is torn, and the reader reports it.
``meta.json`` is replaced atomically (write, fsync, rename), never edited in place.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import orjson

from ..model import KINDS, RECORD_TYPES, CaptureMeta, SourceStatus, to_dict

log = logging.getLogger(__name__)

SEGMENT_BYTES_DEFAULT = 64 * 1024 * 1024


def segment_name(kind: str, index: int) -> str:
    return f"{kind}-{index:06d}.jsonl"


def write_meta(folder: Path, meta: CaptureMeta) -> None:
    data = orjson.dumps(dataclasses.asdict(meta), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    tmp = folder / f".meta.json.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / "meta.json")


class CaptureWriter:
    """Writes records of any kind to a capture folder; thread-safe.

    ``segment_bytes`` rotates a stream to a new segment once it is that large;
    ``max_bytes`` (optional) bounds the whole capture by deleting each stream's oldest
    segments, so a long-running sidecar cannot fill the disk.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        meta: CaptureMeta | None = None,
        *,
        segment_bytes: int = SEGMENT_BYTES_DEFAULT,
        max_bytes: int | None = None,
        fsync_every_s: float = 1.0,
    ):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.meta = meta or CaptureMeta(created_unix_s=time.time())
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        self.fsync_every_s = fsync_every_s
        self._lock = threading.Lock()
        self._files: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}
        self._index: dict[str, int] = {}
        self._last_fsync = time.monotonic()
        self.counts: dict[str, int] = {k: 0 for k in KINDS}
        write_meta(self.folder, self.meta)

    # -- meta -------------------------------------------------------------------------
    def update_meta(self, **changes: Any) -> CaptureMeta:
        with self._lock:
            self.meta = dataclasses.replace(self.meta, **changes)
            write_meta(self.folder, self.meta)
            return self.meta

    def source_status(self, name: str, ok: bool, detail: str = "") -> None:
        """Record once what a source could or could not read."""
        current = self.meta.sources.get(name)
        if current is not None and current.ok == ok and current.detail == detail:
            return
        sources = dict(self.meta.sources)
        sources[name] = SourceStatus(ok=ok, detail=detail)
        self.update_meta(sources=sources)

    # -- records ----------------------------------------------------------------------
    def write(self, record: Any) -> None:
        kind = kind_of(record)
        self.write_dict(kind, to_dict(record))

    def write_many(self, records: Iterable[Any]) -> int:
        n = 0
        for r in records:
            self.write(r)
            n += 1
        return n

    def write_dict(self, kind: str, data: dict[str, Any]) -> None:
        line = orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        with self._lock:
            f = self._file_for(kind, len(line))
            f.write(line)  # one write of a whole line on an unbuffered file
            self._sizes[kind] += len(line)
            self.counts[kind] += 1
            now = time.monotonic()
            if now - self._last_fsync >= self.fsync_every_s:
                self._fsync_all()
                self._last_fsync = now

    def _file_for(self, kind: str, incoming: int):
        if kind not in RECORD_TYPES:
            raise ValueError(f"unknown record kind {kind!r}; expected one of {', '.join(KINDS)}")
        f = self._files.get(kind)
        if f is not None and self._sizes[kind] + incoming <= self.segment_bytes:
            return f
        if f is not None:
            f.close()
        index = self._index.get(kind) or self._last_index(kind)
        index += 1
        self._index[kind] = index
        path = self.folder / segment_name(kind, index)
        f = open(path, "ab", buffering=0)
        self._files[kind] = f
        self._sizes[kind] = path.stat().st_size
        self._enforce_budget()
        return f

    def _last_index(self, kind: str) -> int:
        existing = sorted(self.folder.glob(f"{kind}-*.jsonl"))
        return int(existing[-1].stem.split("-")[-1]) if existing else 0

    def _enforce_budget(self) -> None:
        if not self.max_bytes:
            return
        segments = sorted(self.folder.glob("*-*.jsonl"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in segments)
        open_paths = {Path(f.name) for f in self._files.values()}
        for p in segments:
            if total <= self.max_bytes:
                break
            if p in open_paths:
                continue
            total -= p.stat().st_size
            log.info("capture over %d bytes: dropping oldest segment %s", self.max_bytes, p.name)
            p.unlink(missing_ok=True)

    def _fsync_all(self) -> None:
        for f in self._files.values():
            try:
                os.fsync(f.fileno())
            except OSError:  # a full or read-only disk must not stop the sidecar
                log.warning("fsync failed for %s", f.name, exc_info=True)

    def flush(self) -> None:
        with self._lock:
            self._fsync_all()

    def close(self) -> None:
        with self._lock:
            self._fsync_all()
            for f in self._files.values():
                f.close()
            self._files.clear()
            write_meta(self.folder, self.meta)

    def __enter__(self) -> "CaptureWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def kind_of(record: Any) -> str:
    for kind, cls in RECORD_TYPES.items():
        if isinstance(record, cls):
            return kind
    raise TypeError(f"not a capture record: {type(record).__name__}")
