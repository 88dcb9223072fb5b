"""Append-only, crash-safe capture writer.

A capture is a folder: ``meta.json`` plus one stream of JSON Lines segments per record kind
(``requests-000001.jsonl``, ``gpu-000001.jsonl``, ...). Each record is one line written with a
single ``write`` on an unbuffered file, so a writer killed at any moment leaves every complete
line readable; at worst the last line of a segment is torn, and the reader reports it.
``meta.json`` is replaced atomically (write, fsync, rename), never edited in place.

A write that fails or comes up short (a full disk) is rolled back to the last whole record
(the segment is truncated; if even that fails, the next record starts a new segment), so
records appended once space returns are never glued to a fragment. In ``drop_on_error`` mode
(the sidecar) the record is counted as dropped and a ``capture-dropped`` event is written once
writing works again; otherwise (import) the error is raised after the rollback.

Fields that grow with one request (ITL gaps, prefix-block hashes) are capped where written
(:data:`MAX_LIST_ITEMS`), so one huge request cannot make a line the reader must hold whole.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import orjson

from ..model import KINDS, RECORD_TYPES, CaptureMeta, SourceStatus, to_dict
from .segment_index import INDEX_NAME, TIME_FIELDS

log = logging.getLogger(__name__)

SEGMENT_BYTES_DEFAULT = 64 * 1024 * 1024
#: per-request list fields keep at most this many items (ITL gaps: the first ones; prefix-block
#: hashes: the first blocks, i.e. the prefix that reuse is about); summaries use the full list
MAX_LIST_ITEMS = 16384
_INT64_MIN, _INT64_SPAN = -(1 << 63), 1 << 64


def segment_name(kind: str, index: int) -> str:
    return f"{kind}-{index:06d}.jsonl"


def append_index(folder: Path, segment: str, size_bytes: int, records: int, min_s: float, max_s: float) -> None:
    """One line of the segment index (segment_index.py) for a closed segment; one write, so a
    crash leaves whole lines."""
    line = orjson.dumps({"segment": segment, "bytes": size_bytes, "records": records, "min_s": min_s, "max_s": max_s})
    with open(folder / INDEX_NAME, "ab", buffering=0) as f:
        f.write(line + b"\n")


def write_meta(folder: Path, meta: CaptureMeta) -> None:
    data = dumps(dataclasses.asdict(meta), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    tmp = folder / f".meta.json.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / "meta.json")
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk must not leave half a meta.json behind
        raise


def _plain(v: Any) -> Any:
    """What orjson cannot write, made writable: ints beyond 64 bits become floats (the reader
    reads numbers as float64 anyway), other odd objects their str."""
    if isinstance(v, bool) or v is None or isinstance(v, (str, float)):
        return v
    if isinstance(v, int):
        return v if -(1 << 63) <= v < (1 << 64) else float(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if dataclasses.is_dataclass(v):
        return _plain(dataclasses.asdict(v))
    try:
        return orjson.loads(orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY))
    except (TypeError, orjson.JSONEncodeError):
        return str(v)


def dumps(data: Any, option: int = 0) -> bytes:
    """orjson.dumps that never fails on a value a source handed us (a 24-digit number, ...)."""
    try:
        return orjson.dumps(data, option=option | orjson.OPT_SERIALIZE_NUMPY)
    except (TypeError, orjson.JSONEncodeError):
        return orjson.dumps(_plain(data), option=option)


def bound_engine(data: dict[str, Any], warn: Callable[[str, str], None]) -> dict[str, Any]:
    """An engine sample as analysis can trust it: a negative counter (counters only rise from
    zero) is left out, and a histogram's buckets are made cumulative and its count at least its
    +Inf bucket; each fix is told once through ``warn``."""
    from ..engines import NEUTRAL

    values = data.get("values")
    if isinstance(values, dict):
        bad = [k for k, v in values.items() if isinstance(v, (int, float)) and v < 0
               and getattr(NEUTRAL.get(k), "kind", "") == "counter"]
        if bad:
            for k in bad:
                warn(f"negative:{k}", f"engine counter {k} = {values[k]!r} is negative: left out")
            data = {**data, "values": {k: v for k, v in values.items() if k not in bad}}
    hists = data.get("histograms")
    if isinstance(hists, dict):
        fixed = {}
        for name, h in hists.items():
            cum, count = (h.get("cum"), h.get("count")) if isinstance(h, dict) else (None, None)
            if not isinstance(cum, list) or not cum or not all(isinstance(c, (int, float)) for c in cum):
                fixed[name] = h
                continue
            mono = [max(c, 0) for c in cum]
            for i in range(1, len(mono)):
                mono[i] = max(mono[i], mono[i - 1])
            h2 = dict(h, cum=mono) if mono != cum else h
            if mono != cum:
                warn(f"cumulative:{name}", f"engine histogram {name}: buckets not cumulative (or negative): made cumulative")
            if isinstance(count, (int, float)) and count < mono[-1]:
                warn(f"count:{name}", f"engine histogram {name}: count {count!r} below its largest bucket {mono[-1]!r}: raised to it")
                h2 = dict(h2, count=mono[-1])
            fixed[name] = h2
        data = {**data, "histograms": fixed}
    return data


def bound_request(data: dict[str, Any]) -> dict[str, Any]:
    """Cap the per-request lists and keep prefix-block hashes in the reader's int64 range."""
    itl = data.get("itl_s")
    if isinstance(itl, list) and len(itl) > MAX_LIST_ITEMS:
        import numpy as np

        a = np.asarray(itl, dtype=float)
        data = {**data, "itl_s": itl[:MAX_LIST_ITEMS], "itl_count": len(itl)}
        data.setdefault("itl_p50_s", float(np.percentile(a, 50)))
        data.setdefault("itl_p99_s", float(np.percentile(a, 99)))
        data.setdefault("itl_max_s", float(a.max()))
    hashes = data.get("prefix_block_hashes")
    if isinstance(hashes, list):
        if len(hashes) > MAX_LIST_ITEMS:
            data = {**data, "prefix_block_hashes": hashes[:MAX_LIST_ITEMS], "prefix_blocks_count": len(hashes)}
            hashes = data["prefix_block_hashes"]
        if any(isinstance(h, int) and h >= -_INT64_MIN for h in hashes):
            # unsigned 64-bit ids (Mooncake's) folded onto int64: same equality, readable as int64
            data = {**data, "prefix_block_hashes": [h - _INT64_SPAN if isinstance(h, int) and h >= -_INT64_MIN else h
                                                    for h in hashes]}
    return data


class CaptureWriter:
    """Writes records of any kind to a capture folder; thread-safe.

    ``segment_bytes`` rotates a stream to a new segment once it is that large;
    ``max_bytes`` (optional) bounds the whole capture by deleting each stream's oldest
    segments, so a long-running sidecar cannot fill the disk. ``drop_on_error``: a record
    that cannot be written is counted in ``dropped`` (and ``last_error`` says why) instead
    of raising; meta changes that cannot be written are kept and written at the next chance.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        meta: CaptureMeta | None = None,
        *,
        segment_bytes: int = SEGMENT_BYTES_DEFAULT,
        max_bytes: int | None = None,
        fsync_every_s: float = 1.0,
        drop_on_error: bool = False,
    ):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.meta = meta or CaptureMeta(created_unix_s=time.time())
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        self.fsync_every_s = fsync_every_s
        self.drop_on_error = drop_on_error
        self._lock = threading.RLock()
        self._files: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}
        self._index: dict[str, int] = {}
        #: kind -> [records, min time, max time] of its open segment, indexed when it closes
        self._spans: dict[str, list] = {}
        self._last_fsync = time.monotonic()
        self.counts: dict[str, int] = {k: 0 for k in KINDS}
        self.dropped: dict[str, int] = {k: 0 for k in KINDS}
        self._unreported: dict[str, int] = {}  # drops not yet told in a capture-dropped event
        self.last_error: str | None = None
        self.warnings: list[str] = []  # values fixed on their way in (negative counters, ...)
        self._warned: set[str] = set()
        self._meta_dirty = False
        self._write_meta()

    # -- meta -------------------------------------------------------------------------
    def _write_meta(self) -> None:
        try:
            write_meta(self.folder, self.meta)
            self._meta_dirty = False
        except OSError as e:
            self._meta_dirty = True
            self._failed(f"meta.json: {e.strerror or e}")
            if not self.drop_on_error:
                raise

    def update_meta(self, **changes: Any) -> CaptureMeta:
        with self._lock:
            self.meta = dataclasses.replace(self.meta, **changes)
            self._write_meta()
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
        if kind not in RECORD_TYPES:
            raise ValueError(f"unknown record kind {kind!r}; expected one of {', '.join(KINDS)}")
        if kind == "requests":
            data = bound_request(data)
        elif kind == "engine":
            data = bound_engine(data, self._warn_once)
        line = dumps(data) + b"\n"
        with self._lock:
            if not self._append(kind, line):
                return
            span = self._spans.setdefault(kind, [0, float("inf"), float("-inf")])
            span[0] += 1
            times = [data.get(name) for name in TIME_FIELDS]
            if times[1] is None and times[0].__class__ in (float, int) and data.get("e2e_s").__class__ in (float, int):
                times.append(times[0] + data["e2e_s"])  # the reader derives the finish so
            for v in times:
                if v.__class__ in (float, int) and v == v:
                    span[1], span[2] = min(span[1], v), max(span[2], v)
            if self._unreported or self._meta_dirty:
                self._recovered()

    def _append(self, kind: str, line: bytes) -> bool:
        """One whole line or nothing: a failed or short write is truncated away."""
        f = None
        try:
            f = self._file_for(kind, len(line))
            start = self._sizes[kind]
            written = f.write(line)  # one write of a whole line on an unbuffered file
            if written != len(line):
                raise OSError(28, f"short write ({written or 0} of {len(line)} bytes)")
        except OSError as e:
            if f is not None:
                self._roll_back(kind, f, start)
            self._drop(kind, f"{segment_name(kind, self._index.get(kind, 0))}: {e.strerror or e}")
            if not self.drop_on_error:
                raise
            return False
        self._sizes[kind] += len(line)
        self.counts[kind] += 1
        now = time.monotonic()
        if now - self._last_fsync >= self.fsync_every_s:
            self._fsync_all()
            self._last_fsync = now
        return True

    def _roll_back(self, kind: str, f: Any, size: int) -> None:
        try:
            os.ftruncate(f.fileno(), size)  # frees what the fragment took, so it works on a full disk
        except OSError:  # cannot cut the fragment: leave it as the torn last line of this segment
            log.warning("capture: could not truncate %s after a failed write; starting a new segment", f.name)
            f.close()
            self._files.pop(kind, None)

    def _warn_once(self, key: str, text: str) -> None:
        """A value fixed on its way in: warned once per kind of fix and field, kept in ``warnings``."""
        if key not in self._warned and len(self._warned) < 1000:
            self._warned.add(key)
            self.warnings.append(text)
            log.warning("capture: %s", text)

    def _drop(self, kind: str, reason: str) -> None:
        self.dropped[kind] += 1
        self._unreported[kind] = self._unreported.get(kind, 0) + 1
        self._failed(reason)

    def _failed(self, reason: str) -> None:
        if self.last_error != reason:  # once per distinct failure, not once per record
            log.warning("capture: cannot write (%s); records are dropped and counted until it works again", reason)
        self.last_error = reason

    def _recovered(self) -> None:
        """Writing works again: write the meta left pending and say what was lost, as an event."""
        if self._meta_dirty:
            self._write_meta()
        if self._unreported:
            lost, reason = dict(self._unreported), self.last_error
            self._unreported.clear()
            event = {"time_s": time.time(), "kind": "capture-dropped",
                     "detail": {"records": sum(lost.values()), "by_kind": lost, "reason": reason}}
            if not self._append("events", dumps(event) + b"\n"):
                for k, n in lost.items():  # still failing: keep them for the next event
                    self._unreported[k] = self._unreported.get(k, 0) + n
                return
            log.warning("capture: writing again; %d record(s) were dropped (%s)", sum(lost.values()), reason)
        self.last_error = None

    def _file_for(self, kind: str, incoming: int):
        f = self._files.get(kind)
        if f is not None and self._sizes[kind] + incoming <= self.segment_bytes:
            return f
        if f is not None:
            f.close()
            self._files.pop(kind, None)
            self._close_span(kind)
        index = self._index.get(kind) or self._last_index(kind)
        index += 1
        self._index[kind] = index
        path = self.folder / segment_name(kind, index)
        f = open(path, "ab", buffering=0)
        self._files[kind] = f
        self._sizes[kind] = os.fstat(f.fileno()).st_size
        self._enforce_budget()
        return f

    def _close_span(self, kind: str) -> None:
        """Index the segment just closed (its records' time span): a reader asked for a time range
        then skips it without parsing it. Best effort: an unindexed segment is simply read."""
        span = self._spans.pop(kind, None)
        if not span or not span[0] or span[1] > span[2]:
            return
        name = segment_name(kind, self._index[kind])
        try:
            append_index(self.folder, name, (self.folder / name).stat().st_size, span[0], span[1], span[2])
        except OSError as e:
            self._warn_once("index", f"{INDEX_NAME}: {e.strerror or e}; segments stay unindexed (read in full)")

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
        """Flush and close. Raises OSError (after closing everything) when the final meta.json
        cannot be written and the writer raises on errors."""
        with self._lock:
            self._fsync_all()
            for kind, f in list(self._files.items()):
                try:
                    f.close()
                except OSError:
                    pass
                self._close_span(kind)
            self._files.clear()
            self._write_meta()

    def __enter__(self) -> "CaptureWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def kind_of(record: Any) -> str:
    for kind, cls in RECORD_TYPES.items():
        if isinstance(record, cls):
            return kind
    raise TypeError(f"not a capture record: {type(record).__name__}")
