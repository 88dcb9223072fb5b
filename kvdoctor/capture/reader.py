"""Fast columnar load of a capture folder.

Requests, GPU and host streams are parsed by Arrow's multithreaded JSON reader straight into
columns; the engine and event streams (small, nested) by orjson. A line that is not a whole
JSON object (the writer was killed mid-write, or an old writer appended after a full disk) is
skipped with a warning in ``Capture.warnings`` naming file and line, and the rest is read; a
segment with no readable line at all is an error. Arrow's block size follows the longest line,
so whatever the writer wrote is read; nesting deeper than the format has (:data:`MAX_DEPTH`) is
refused before Arrow sees it (Arrow's parser recurses without bound).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from ..errors import InputError
from ..model import FORMAT_VERSION, CaptureMeta, GpuSample, HostSample, RequestRecord, SourceStatus

#: how a field's annotation is read into a column: counts as float64 (NaN for missing); a field's
#: ``metadata["column"]`` overrides ("int64" for ids and indexes, None: written, never loaded)
_ARROW = {"str": pa.string(), "float": pa.float64(), "int": pa.float64(), "int64": pa.int64(),
          "list[float]": pa.list_(pa.float64()), "list[int]": pa.list_(pa.int64())}


def schema_of(record: type) -> pa.Schema:
    """The Arrow schema of a record dataclass in kvdoctor.model: declared once, read as written."""
    cols = []
    for f in dataclasses.fields(record):
        kind = f.metadata.get("column", "auto")
        if kind is None:
            continue
        cols.append((f.name, _ARROW[f.type.split(" | ")[0] if kind == "auto" else kind]))
    return pa.schema(cols)


REQUEST_SCHEMA = schema_of(RequestRecord)
GPU_SCHEMA = schema_of(GpuSample)
HOST_SCHEMA = schema_of(HostSample)

SCHEMAS = {"requests": REQUEST_SCHEMA, "gpu": GPU_SCHEMA, "host": HOST_SCHEMA}


class Columns:
    """A table with cached numpy views: floats with NaN for missing, strings as codes."""

    def __init__(self, table: pa.Table):
        self.table = table
        self._num: dict[str, np.ndarray] = {}
        self._nan: np.ndarray | None = None
        self._codes: dict[str, tuple[np.ndarray, list[str]]] = {}

    def __len__(self) -> int:
        return self.table.num_rows

    def has(self, name: str) -> bool:
        return name in self.table.column_names and self.table.column(name).null_count < len(self)

    def num(self, name: str) -> np.ndarray:
        """Column as float64, NaN where missing (all NaN when the column is absent)."""
        arr = self._num.get(name)
        if arr is None:
            if name in self.table.column_names and self.table.column(name).null_count < len(self):
                col = self.table.column(name)
                if not pa.types.is_floating(col.type):
                    col = pc.cast(col, pa.float64())
                arr = col.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
                if col.null_count:  # Arrow nulls become NaN
                    arr = np.where(pc.is_null(col).to_numpy(zero_copy_only=False), np.nan, arr)
            else:  # absent: one shared read-only NaN column (a capture often lacks a dozen fields)
                if self._nan is None:
                    self._nan = np.full(len(self), np.nan)
                    self._nan.flags.writeable = False
                arr = self._nan
            self._num[name] = arr
        return arr

    def codes(self, name: str) -> tuple[np.ndarray, list[str]]:
        """String column as (int32 codes, labels); -1 where missing."""
        hit = self._codes.get(name)
        if hit is None:
            if name not in self.table.column_names:
                hit = (np.full(len(self), -1, dtype=np.int32), [])
            else:
                d = pc.dictionary_encode(self.table.column(name)).combine_chunks()
                idx = d.indices.to_numpy(zero_copy_only=False)
                idx = np.where(d.is_null().to_numpy(zero_copy_only=False), -1, idx).astype(np.int32)
                hit = (idx, d.dictionary.to_pylist())
            self._codes[name] = hit
        return hit

    def lists(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """List column as (offsets, values), or None when absent or empty."""
        if name not in self.table.column_names or self.table.column(name).null_count == len(self):
            return None
        col = self.table.column(name).combine_chunks()
        col = pc.fill_null(col, pa.scalar([], type=col.type))
        return col.offsets.to_numpy(), col.values.to_numpy(zero_copy_only=False)

    def strings(self, name: str) -> list[Any]:
        return self.table.column(name).to_pylist() if name in self.table.column_names else [None] * len(self)

    def filter(self, mask: np.ndarray) -> "Columns":
        return Columns(self.table.filter(pa.array(mask)))


@dataclass
class EngineSeries:
    """Engine samples as one time array and per-name value arrays (NaN where absent)."""

    time_s: np.ndarray
    values: dict[str, np.ndarray]
    histograms: dict[str, list[tuple[float, dict[str, Any]]]]
    servers: list[str | None]
    engine: str | None

    def get(self, name: str) -> np.ndarray | None:
        return self.values.get(name)


@dataclass
class Capture:
    path: Path
    meta: CaptureMeta
    requests: Columns
    gpu: Columns
    host: Columns
    engine: EngineSeries
    events: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)

    @property
    def start_s(self) -> float | None:
        return _first_time(self, np.nanmin)

    @property
    def end_s(self) -> float | None:
        return _first_time(self, np.nanmax)


def _first_time(cap: Capture, fn) -> float | None:
    cands = []
    for arr in (cap.requests.num("arrival_s"), cap.requests.num("finish_s"), cap.gpu.num("time_s"),
                cap.host.num("time_s"), cap.engine.time_s):
        if len(arr) and not np.all(np.isnan(arr)):
            cands.append(fn(arr))
    return float(fn(np.array(cands))) if cands else None


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


def _read_dicts(folder: Path, kind: str, warnings: list[str]) -> list[dict[str, Any]]:
    out = []
    for seg in segments(folder, kind):
        out += _whole_lines(seg, seg.read_bytes(), warnings)[0]
    return out


def _engine_series(rows: list[dict[str, Any]]) -> EngineSeries:
    rows.sort(key=lambda r: r.get("time_s", 0.0))
    n = len(rows)
    t = np.array([float(r.get("time_s", np.nan)) for r in rows], dtype=float)
    values: dict[str, np.ndarray] = {}
    hists: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for i, r in enumerate(rows):
        for k, v in (r.get("values") or {}).items():
            arr = values.get(k)
            if arr is None:
                arr = values[k] = np.full(n, np.nan)
            if isinstance(v, (int, float)):
                arr[i] = v
        for k, h in (r.get("histograms") or {}).items():
            hists.setdefault(k, []).append((t[i], h))
    engines = {r.get("engine") for r in rows if r.get("engine")}
    return EngineSeries(time_s=t, values=values, histograms=hists,
                        servers=[r.get("server") for r in rows],
                        engine=next(iter(engines)) if len(engines) == 1 else None)


def _derive(table: pa.Table) -> pa.Table:
    """Vectorised counterpart of model.derive_request: fill what follows from other fields."""
    def num(name):
        return table.column(name)

    def fill(name, expr):
        nonlocal table
        col = table.column(name)
        if col.null_count == 0:
            return
        new = pc.coalesce(col, expr)
        table = table.set_column(table.schema.get_field_index(name), name, new)

    arrival = num("arrival_s")
    fill("ttft_s", pc.subtract(num("first_token_s"), arrival))
    fill("e2e_s", pc.subtract(num("finish_s"), arrival))
    fill("finish_s", pc.add(arrival, num("e2e_s")))
    fill("first_token_s", pc.add(arrival, num("ttft_s")))
    out_tok = num("output_tokens")
    decode = pc.max_element_wise(pc.subtract(num("e2e_s"), num("ttft_s")), pa.scalar(0.0), skip_nulls=False)
    tpot = pc.if_else(pc.greater(out_tok, 1), pc.divide(decode, pc.subtract(out_tok, 1)), pa.scalar(None, pa.float64()))
    fill("tpot_s", tpot)
    fill("status", pc.if_else(pc.is_null(num("error")), pa.scalar("ok"), pa.scalar("error")))
    return table


def load_meta(folder: Path) -> CaptureMeta:
    path = folder / "meta.json"
    if not path.exists():
        return CaptureMeta(clock="relative")
    try:
        raw = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path}: expected a JSON object (format_version, sources, config, ...), got {type(raw).__name__}")
    version = raw.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise InputError(f"{path}: field format_version: expected an integer <= {FORMAT_VERSION}, got {version!r}; "
                         "upgrade kvdoctor to read this capture")
    # readers ignore unknown fields, at every level (newer writers add them)
    kwargs = {}
    for f in dataclasses.fields(CaptureMeta):
        if f.name not in raw or f.name == "sources":
            continue
        v = raw[f.name]
        if v is None:  # as if absent
            continue
        expected = _META_TYPES.get(f.name, ())
        if expected and not (bool in expected if isinstance(v, bool) else isinstance(v, expected)):
            names = " or ".join(t.__name__ for t in expected)
            raise InputError(f"{path}: field {f.name}: expected {names}, got {type(v).__name__} {str(v)[:40]!r}")
        kwargs[f.name] = v
    sources = raw.get("sources") or {}
    if not isinstance(sources, dict):
        raise InputError(f"{path}: field sources: expected an object of name: {{ok, detail}}")
    status_fields = {f.name for f in dataclasses.fields(SourceStatus)}
    kwargs["sources"] = {str(k): SourceStatus(**{a: b for a, b in v.items() if a in status_fields} | {"ok": bool(v.get("ok"))})
                         if isinstance(v, dict) else SourceStatus(ok=bool(v)) for k, v in sources.items()}
    return CaptureMeta(**kwargs)


_META_TYPES: dict[str, tuple[type, ...]] = {
    "created_unix_s": (int, float), "clock": (str,), "engine": (str,), "model": (str,), "gpu": (str,),
    "server": (str,), "origin": (str,), "config": (dict,), "text_stored": (bool,), "tool_version": (str,),
    "attribution": (str,),
}


def load(path: str | Path, *, since_s: float | None = None, until_s: float | None = None) -> Capture:
    """Load a capture folder. ``since_s``/``until_s`` keep records in that time range."""
    folder = Path(path)
    if not folder.exists():
        raise InputError(f"{folder}: no such capture; expected a folder written by `kvdoctor attach` or `kvdoctor import`")
    if not folder.is_dir():
        raise InputError(f"{folder}: a capture is a folder (meta.json + *.jsonl segments); "
                         f"to read another tool's file, run `kvdoctor import FORMAT {folder} -o CAPTURE` first")
    if not (folder / "meta.json").exists() and not any(folder.glob("*-*.jsonl")):
        raise InputError(f"{folder}: not a capture (no meta.json and no *-NNNNNN.jsonl segments)")
    warnings: list[str] = []
    meta = load_meta(folder)
    requests = Columns(_derive(_read_table(folder, "requests", warnings)))
    gpu = Columns(_read_table(folder, "gpu", warnings))
    host = Columns(_read_table(folder, "host", warnings))
    engine = _engine_series(_read_dicts(folder, "engine", warnings))
    events = _read_dicts(folder, "events", warnings)
    cap = Capture(folder, meta, requests, gpu, host, engine, events, warnings)
    if since_s is not None or until_s is not None:
        cap = time_slice(cap, since_s, until_s)
    return cap


def _in_range(t: np.ndarray, lo: float | None, hi: float | None) -> np.ndarray:
    m = np.ones(len(t), dtype=bool)
    if lo is not None:
        m &= t >= lo
    if hi is not None:
        m &= t <= hi
    return m


def time_slice(cap: Capture, lo: float | None, hi: float | None) -> Capture:
    t_req = cap.requests.num("arrival_s")
    t_req = np.where(np.isnan(t_req), cap.requests.num("finish_s"), t_req)
    e = cap.engine
    m = _in_range(e.time_s, lo, hi)
    engine = EngineSeries(e.time_s[m], {k: v[m] for k, v in e.values.items()},
                          {k: [(t, h) for t, h in v if _in_range(np.array([t]), lo, hi)[0]] for k, v in e.histograms.items()},
                          [s for s, keep in zip(e.servers, m) if keep], e.engine)
    events = [ev for ev in cap.events if _in_range(np.array([ev.get("time_s", np.nan)]), lo, hi)[0]]
    return dataclasses.replace(
        cap,
        requests=cap.requests.filter(_in_range(t_req, lo, hi)),
        gpu=cap.gpu.filter(_in_range(cap.gpu.num("time_s"), lo, hi)),
        host=cap.host.filter(_in_range(cap.host.num("time_s"), lo, hi)),
        engine=engine,
        events=events,
    )
