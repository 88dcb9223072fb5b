"""Crash-tolerant reading of a stream's segments (``KIND-NNNNNN.jsonl``).

Requests, GPU and host segments go to Arrow's multithreaded JSON reader; engine and event
segments (small, nested) to orjson line by line. A line that is not a whole JSON object (the
writer was killed mid-write, or an old writer appended after a full disk) is skipped with a
warning naming file and line; a segment with no readable line at all is an error. Arrow's block
size follows the longest line, and nesting deeper than :data:`MAX_DEPTH` is refused before
Arrow sees it (Arrow's parser recurses without bound).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.json as pajson

from ..errors import InputError
from .columns import SCHEMAS


def segments(folder: Path, kind: str) -> list[Path]:
    return sorted(folder.glob(f"{kind}-*.jsonl"))


#: the format nests a few levels; Arrow's JSON parser recurses per level (a line some 20,000
#: levels deep crashes the process), so a line deeper than this never reaches it
MAX_DEPTH = 512
_BLOCK_BYTES = 1 << 20
_BRACKETS = np.zeros(256, dtype=np.int32)
_BRACKETS[[ord("["), ord("{")]] = 1
_BRACKETS[[ord("]"), ord("}")]] = -1


def _scan(data: bytes) -> tuple[int, bool]:
    """(longest line in bytes, whether some line may nest deeper than MAX_DEPTH). Only lines
    long enough to hold MAX_DEPTH brackets pairs, and holding that many openers, are walked."""
    nl = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    starts = np.concatenate(([0], nl + 1))
    ends = np.concatenate((nl, [len(data)]))
    lengths = ends - starts
    longest = int(lengths.max()) if len(lengths) else 0
    for i in np.flatnonzero(lengths > 2 * MAX_DEPTH):
        s, e = int(starts[i]), int(ends[i])
        if data.count(b"[", s, e) + data.count(b"{", s, e) <= MAX_DEPTH:
            continue
        depth = np.cumsum(_BRACKETS[np.frombuffer(data, dtype=np.uint8, count=e - s, offset=s)])
        if depth.max() > MAX_DEPTH:  # brackets inside strings count too: a bound, never an underestimate
            return longest, True
    return longest, False


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value, counting no further than ``limit + 1``."""
    if limit < 0 or not isinstance(obj, (dict, list)):
        return 0
    items = obj.values() if isinstance(obj, dict) else obj
    return 1 + max((_depth(x, limit - 1) for x in items), default=0)


def _whole_lines(path: Path, data: bytes, warnings: list[str]) -> tuple[list[dict[str, Any]], bytes]:
    """The segment's readable records (and their lines), skipping each line that is not a whole
    JSON object with a located warning. A line where an old writer appended a record after a
    torn fragment keeps the record after the fragment."""
    out, kept, bad = [], [], 0
    lines = data.split(b"\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        obj = _loads_object(line)
        if obj is None:  # a fragment glued to a whole record: the record starts at a later '{"'
            at = line.find(b'{"', 1)
            while at > 0 and obj is None:
                obj = _loads_object(line[at:])
                if obj is not None:
                    line = line[at:]
                    _warn(warnings, bad, f"{path}: line {i}: torn record ({at} bytes) before a whole one; "
                          "kept the whole one")
                    bad += 1
                else:
                    at = line.find(b'{"', at + 1)
        if obj is None or _depth(obj, MAX_DEPTH) > MAX_DEPTH:
            what = "not a whole JSON object" if obj is None else f"nested deeper than {MAX_DEPTH} levels"
            last = i == len(lines)
            _warn(warnings, bad, f"{path}: line {i}: {'torn last line' if last else what} ({len(line)} bytes) "
                  "skipped" + ("; the writer was stopped mid-record" if last else ""))
            bad += 1
            continue
        out.append(obj)
        kept.append(line)
    if bad > 5:
        warnings.append(f"{path}: {bad} unreadable lines skipped in all (first 5 named above)")
    if bad and not out and bad > 1:
        raise InputError(f"{path}: no line is a capture record ({bad} unreadable lines); "
                         "expected one JSON object per line")
    return out, b"\n".join(kept) + b"\n" if kept else b""


def _loads_object(line: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _warn(warnings: list[str], n_before: int, text: str) -> None:
    if n_before < 5:
        warnings.append(text)


def _clean(seg: Path, data: bytes, warnings: list[str]) -> bytes:
    """The segment's bytes with unreadable lines dropped (warned), for Arrow."""
    return _whole_lines(seg, data, warnings)[1]


def _conform(table: pa.Table, schema: pa.Schema, seg: Path) -> pa.Table:
    """Cast what the reader inferred to the capture schema; absent fields become null columns,
    unknown ones are dropped (newer writers may add fields)."""
    cols = []
    for f in schema:
        if f.name in table.column_names:
            col = table.column(f.name)
            if col.type != f.type:
                try:
                    col = col.cast(f.type) if not pa.types.is_null(col.type) else pa.nulls(len(table), f.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    raise InputError(f"{seg}: field {f.name}: expected {f.type}, found {col.type} values") from None
            cols.append(col)
        else:
            cols.append(pa.nulls(len(table), f.type))
    return pa.Table.from_arrays(cols, schema=schema)


def _read_table(folder: Path, kind: str, warnings: list[str]) -> pa.Table:
    schema = SCHEMAS[kind]
    tables = []
    for seg in segments(folder, kind):
        data = seg.read_bytes()
        if not data:
            continue
        longest, too_deep = _scan(data)
        if too_deep or not data.endswith(b"\n"):
            data = _clean(seg, data, warnings)  # per line in Python: Arrow never sees what is too deep
            if not data:
                continue
            longest = _scan(data)[0]
        # Letting Arrow infer types and casting afterwards is ~1.5x faster than an explicit
        # schema (measured on 1M requests); Arrow promotes int -> double across blocks itself.
        # A block must hold the longest line whole, or Arrow refuses the file.
        ropts = pajson.ReadOptions(block_size=max(_BLOCK_BYTES, 1 << (longest + 1).bit_length()))
        try:
            table = pajson.read_json(pa.BufferReader(pa.py_buffer(data)), read_options=ropts)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            cleaned = _clean(seg, data, warnings)
            try:
                if len(cleaned) == len(data) or not cleaned:
                    raise pa.ArrowInvalid(str(e))
                table = pajson.read_json(pa.BufferReader(pa.py_buffer(cleaned)), read_options=ropts)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e2:
                raise InputError(f"{seg}: {str(e2).splitlines()[0]}") from None
        tables.append(_conform(table, schema, seg))
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def read_dicts(folder: Path, kind: str, warnings: list[str]) -> list[dict[str, Any]]:
    """Every readable record of one stream (``engine``, ``events``, ...) as a dict, in segment order;
    each unreadable line skipped with a warning appended to ``warnings``."""
    out = []
    for seg in segments(folder, kind):
        out += _whole_lines(seg, seg.read_bytes(), warnings)[0]
    return out

