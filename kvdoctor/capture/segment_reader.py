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
from typing import Any, Callable

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
#: Arrow's JSON block (a table chunk each): 4 MiB keeps a dozen blocks a segment for its threads while
#: every later column operation runs over a quarter of the chunks 1 MiB blocks give
_BLOCK_BYTES = 4 << 20
_BRACKETS = np.zeros(256, dtype=np.int32)
_BRACKETS[[ord("["), ord("{")]] = 1
_BRACKETS[[ord("]"), ord("}")]] = -1


#: bytes per piece of a segment scanned at a time (the comparison's temporary stays in cache)
_SCAN_PIECE = 1 << 18


def _scan(data: bytes) -> tuple[int, bool]:
    """(longest line in bytes, whether some line may nest deeper than MAX_DEPTH). Only lines
    long enough to hold MAX_DEPTH brackets pairs, and holding that many openers, are walked.
    The usual segment (every line shorter than 2 * MAX_DEPTH bytes) is told by one cheap pass:
    then every aligned run of MAX_DEPTH bytes holds a newline."""
    buf = np.frombuffer(data, dtype=np.uint8)
    if _short_lines(buf):
        return 2 * MAX_DEPTH - 2, False  # a bound: no line holds a whole aligned run
    nl = np.concatenate([np.flatnonzero(buf[s:s + _SCAN_PIECE] == 10) + s for s in range(0, len(buf), _SCAN_PIECE)]
                        or [np.array([], dtype=np.int64)])
    starts = np.concatenate(([0], nl + 1))
    ends = np.concatenate((nl, [len(data)]))
    lengths = ends - starts
    longest = int(lengths.max()) if len(lengths) else 0
    long_ = np.flatnonzero(lengths > 2 * MAX_DEPTH)
    if not len(long_):
        return longest, False
    # openers ([ and {) per long line, all at once: sums over [start, end) of each
    opener = (buf == ord("[")) | (buf == ord("{"))
    bounds = np.stack((starts[long_], ends[long_]), axis=1).ravel()
    inside = bounds < len(buf)  # a last line without a newline ends at the end of the data
    sums = np.add.reduceat(opener, bounds[inside], dtype=np.int64)
    per_line = np.zeros(len(bounds), dtype=np.int64)
    per_line[np.flatnonzero(inside)] = sums
    for i in long_[per_line[0::2] > MAX_DEPTH]:  # the rare line with that many openers: walked
        s, e = int(starts[i]), int(ends[i])
        depth = np.cumsum(_BRACKETS[np.frombuffer(data, dtype=np.uint8, count=e - s, offset=s)])
        if depth.max() > MAX_DEPTH:  # brackets inside strings count too: a bound, never an underestimate
            return longest, True
    return longest, False


def _short_lines(buf: np.ndarray) -> bool:
    """Whether every aligned run of MAX_DEPTH bytes holds a newline (then no line reaches
    2 * MAX_DEPTH - 1 bytes), piece by piece."""
    for s in range(0, len(buf) - MAX_DEPTH + 1, _SCAN_PIECE):
        piece = buf[s:s + _SCAN_PIECE]
        piece = piece[:len(piece) // MAX_DEPTH * MAX_DEPTH].reshape(-1, MAX_DEPTH)
        if not (piece == 10).any(axis=1).all():
            return False
    return True


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value, counting no further than ``limit + 1``."""
    if limit < 0 or not isinstance(obj, (dict, list)):
        return 0
    items = obj.values() if isinstance(obj, dict) else obj
    return 1 + max((_depth(x, limit - 1) for x in items), default=0)


def _utf8(path: Path, data: bytes, warnings: list[str]) -> bytes:
    """``data`` as valid UTF-8: a server's error text may carry bytes that are not (a latin-1
    message, a cut multi-byte character); they are read as U+FFFD with one warning, never a crash."""
    if data.isascii():  # the usual capture, told ten times faster than by decoding it
        return data
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        fixed = data.decode("utf-8", errors="replace")
        n = fixed.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")
        warnings.append(f"{path}: line {line}: {n} byte sequence{'s' * (n != 1)} not UTF-8 (first at byte {e.start}); "
                        "read as U+FFFD")
        return fixed.encode("utf-8")
    return data


def _whole_lines(path: Path, data: bytes, warnings: list[str],
                 numbers: list[int] | None = None) -> tuple[list[dict[str, Any]], bytes]:
    """The segment's readable records (and their lines), skipping each line that is not a whole
    JSON object with a located warning. A line where an old writer appended a record after a
    torn fragment keeps the record after the fragment. ``numbers`` receives each record's line."""
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
        if numbers is not None:
            numbers.append(i)
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
    unknown ones are dropped (newer writers may add fields). The absent fields of one type share
    one null array (immutable): a capture lacks a score of fields, each a row's 8 bytes otherwise."""
    nulls: dict[pa.DataType, pa.Array] = {}

    def null_column(t: pa.DataType) -> pa.Array:
        got = nulls.get(t)
        if got is None:
            got = nulls[t] = pa.nulls(len(table), t)
        return got

    cols = []
    for f in schema:
        if f.name in table.column_names:
            col = table.column(f.name)
            if col.type != f.type:
                try:
                    col = col.cast(f.type) if not pa.types.is_null(col.type) else null_column(f.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    raise InputError(f"{seg}: field {f.name}: expected {f.type}, found {col.type} values") from None
            cols.append(col)
        else:
            cols.append(null_column(f.type))
    return pa.Table.from_arrays(cols, schema=schema)


def _read_table(folder: Path, kind: str, warnings: list[str], keep: Callable[[Path], bool] | None = None,
                read: dict[Path, Any] | None = None) -> pa.Table:
    """The stream's segments (those ``keep`` accepts) as one table of the stream's schema;
    ``read``: segments already read (their tables), taken from there."""
    schema = SCHEMAS[kind]
    read = read or {}
    tables = [t for seg in segments(folder, kind) if keep is None or keep(seg)
              if (t := read.pop(seg) if seg in read else read_segment_table(seg, schema, warnings)) is not None]
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def read_segment_table(seg: Path, schema: pa.Schema, warnings: list[str]) -> pa.Table | None:
    """One segment's readable records in ``schema``; None when it holds none."""
    data = _utf8(seg, seg.read_bytes(), warnings)
    if not data:
        return None
    longest, too_deep = _scan(data)
    if too_deep or not data.endswith(b"\n"):
        data = _clean(seg, data, warnings)  # per line in Python: Arrow never sees what is too deep
        if not data:
            return None
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
    if not _lists_valid(table):
        table = _reread_lists(data, table, schema, ropts, seg)
    return _bounded(_conform(table, schema, seg), seg, warnings)


def _lists_valid(table: pa.Table) -> bool:
    """Arrow's JSON reader (26.0) builds a corrupt list column when the first list it infers from
    starts with null (``[null, 0.01]``): offsets past the values. Checked here, not trusted."""
    for col in table.columns:
        if pa.types.is_list(col.type):
            try:
                col.validate(full=True)
            except pa.ArrowInvalid:
                return False
    return True


def _reread_lists(data: bytes, table: pa.Table, schema: pa.Schema, ropts, seg: Path) -> pa.Table:
    """The segment read again with the list fields' types given (Arrow then parses them right)."""
    lists = pa.schema([f for f in schema if pa.types.is_list(f.type) and f.name in table.column_names])
    popts = pajson.ParseOptions(explicit_schema=lists, unexpected_field_behavior="infer")
    try:
        return pajson.read_json(pa.BufferReader(pa.py_buffer(data)), read_options=ropts, parse_options=popts)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise InputError(f"{seg}: {str(e).splitlines()[0]}") from None


#: instants a clock can hold: seconds within ±2.5e11 (year ~9900); a time beyond is no time (1e308
#: ns from a hostile file) and every date formatting downstream would overflow on it
MAX_TIME_S = 2.5e11
#: durations (TTFT, E2E, ...) beyond ~32 years are no measurement either; with the bound above, an
#: instant derived from one (arrival + e2e) still stays a date
MAX_DURATION_S = 1e9
_INSTANTS = ("arrival_s", "first_token_s", "finish_s", "time_s")


def _bounded(table: pa.Table, seg: Path, warnings: list[str]) -> pa.Table:
    """Instants and durations (``*_s`` numbers) beyond their bounds read as missing, with one
    warning per field and segment."""
    import pyarrow.compute as pc

    for f in table.schema:
        if not f.name.endswith("_s") or not pa.types.is_floating(f.type):
            continue
        limit, what = (MAX_TIME_S, "beyond year 9900") if f.name in _INSTANTS else (MAX_DURATION_S, "over 30 years")
        col = table.column(f.name)
        if col.null_count == len(col):  # an absent field: nothing to bound
            continue
        bad = pc.fill_null(pc.greater(pc.abs(col), limit), False)
        n = pc.sum(bad).as_py() or 0
        if n:
            warnings.append(f"{seg}: field {f.name}: {n} value{'s' * (n != 1)} {what} read as missing")
            table = table.set_column(table.schema.get_field_index(f.name), f.name,
                                     pc.if_else(bad, pa.scalar(None, f.type), col))
    return table


def read_dicts(folder: Path, kind: str, warnings: list[str], keep: Callable[[Path], bool] | None = None,
               read: dict[Path, Any] | None = None) -> list[dict[str, Any]]:
    """Engine or event records (of the segments ``keep`` accepts), each checked field by field: a
    record whose fields have the wrong type (a null time, a string of values) is skipped with a
    warning naming the file, line and field, so one bad line neither crashes a reader nor hides the rest."""
    out = []
    read = read or {}
    for seg in segments(folder, kind):
        if keep is None or keep(seg):
            out += read.pop(seg) if seg in read else read_segment_dicts(seg, kind, warnings)
    return out


def read_segment_dicts(seg: Path, kind: str, warnings: list[str]) -> list[dict[str, Any]]:
    check = _CHECKS.get(kind)
    out = []
    numbers: list[int] = []
    records = _whole_lines(seg, _utf8(seg, seg.read_bytes(), warnings), warnings, numbers)[0]
    skipped = 0
    for n, rec in zip(numbers, records):
        why = check(rec) if check else None
        if why is None:
            out.append(rec)
            continue
        if skipped < 5:
            warnings.append(f"{seg}: line {n}: {why}; record skipped")
        skipped += 1
    if skipped > 5:
        warnings.append(f"{seg}: {skipped} {kind} records skipped in all for wrong field types (first 5 named above)")
    return out


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _got(v: Any) -> str:
    s = "null" if v is None else f"{type(v).__name__} {v!r}"
    return s if len(s) <= 40 else s[:37] + "..."


def _common(rec: dict[str, Any]) -> str | None:
    if not _is_num(rec.get("time_s")) or abs(rec["time_s"]) > MAX_TIME_S:
        return f"field time_s: expected a number of seconds (before year 9900), got {_got(rec.get('time_s'))}"
    if rec.get("server") is not None and not isinstance(rec["server"], str):
        return f"field server: expected a string, got {_got(rec['server'])}"
    return None


def _check_engine(rec: dict[str, Any]) -> str | None:
    why = _common(rec)
    if why:
        return why
    if rec.get("engine") is not None and not isinstance(rec["engine"], str):
        return f"field engine: expected a string, got {_got(rec['engine'])}"
    for name in ("values", "histograms"):
        if rec.get(name) is not None and not isinstance(rec[name], dict):
            return f"field {name}: expected an object of name: value, got {_got(rec[name])}"
    for key, h in list((rec.get("histograms") or {}).items()):
        if not _histogram_ok(h):
            return f"field histograms.{key}: expected {{le: [bounds], cum: [counts], sum, count}}, got {_got(h)}"
    return None


def _histogram_ok(h: Any) -> bool:
    if not isinstance(h, dict):
        return False
    le, cum = h.get("le"), h.get("cum")
    if not isinstance(le, list) or not isinstance(cum, list) or len(le) != len(cum):
        return False
    # the writer stores the +Inf bound as null (JSON has no infinity); counts are numbers
    if not all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)) for x in le):
        return False
    if not all(_is_num(x) for x in cum):
        return False
    return all(h.get(k) is None or _is_num(h.get(k)) for k in ("sum", "count"))


def _check_event(rec: dict[str, Any]) -> str | None:
    why = _common(rec)
    if why:
        return why
    if not isinstance(rec.get("kind"), str):
        return f"field kind: expected a string (server-down, config, ...), got {_got(rec.get('kind'))}"
    if rec.get("detail") is not None and not isinstance(rec["detail"], dict):
        return f"field detail: expected an object, got {_got(rec['detail'])}"
    return None


_CHECKS = {"engine": _check_engine, "events": _check_event}

