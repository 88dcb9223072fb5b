"""Fast columnar load of a capture folder.

Requests, GPU and host streams are parsed by Arrow's multithreaded JSON reader straight into
columns; the engine and event streams (small, nested) by orjson. A torn last line (the writer
was killed mid-write) is reported in ``Capture.warnings`` and skipped; a bad line anywhere
else is an error that names the file and line.
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
from ..model import FORMAT_VERSION, CaptureMeta, SourceStatus

REQUEST_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("arrival_s", pa.float64()),
        ("first_token_s", pa.float64()),
        ("finish_s", pa.float64()),
        ("ttft_s", pa.float64()),
        ("tpot_s", pa.float64()),
        ("itl_s", pa.list_(pa.float64())),
        ("itl_p50_s", pa.float64()),
        ("itl_p99_s", pa.float64()),
        ("itl_max_s", pa.float64()),
        ("e2e_s", pa.float64()),
        ("queue_s", pa.float64()),
        ("prompt_tokens", pa.float64()),
        ("output_tokens", pa.float64()),
        ("cached_prompt_tokens", pa.float64()),
        ("session_id", pa.string()),
        ("turn", pa.float64()),
        ("prefix_block_hashes", pa.list_(pa.int64())),
        ("prefix_block_tokens", pa.float64()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("http_status", pa.float64()),
        ("model", pa.string()),
        ("server", pa.string()),
        ("trace_id", pa.string()),
        ("output_repetition", pa.float64()),
        ("baseline_agreement_frac", pa.float64()),
        ("baseline_output_repetition", pa.float64()),
    ]
)

GPU_SCHEMA = pa.schema(
    [
        ("time_s", pa.float64()),
        ("gpu_index", pa.int64()),
        ("name", pa.string()),
        ("mem_used_bytes", pa.float64()),
        ("mem_total_bytes", pa.float64()),
        ("sm_util_frac", pa.float64()),
        ("mem_util_frac", pa.float64()),
        ("dram_bw_util_frac", pa.float64()),
        ("power_w", pa.float64()),
        ("sm_clock_mhz", pa.float64()),
        ("mem_clock_mhz", pa.float64()),
        ("server_proc_mem_bytes", pa.float64()),
    ]
)

HOST_SCHEMA = pa.schema(
    [
        ("time_s", pa.float64()),
        ("server_cpu_cores", pa.float64()),
        ("server_rss_bytes", pa.float64()),
        ("server_pid", pa.int64()),
        ("host_mem_used_bytes", pa.float64()),
        ("host_mem_total_bytes", pa.float64()),
        ("host_cpu_frac", pa.float64()),
    ]
)

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


def _ends_whole(path: Path) -> bool:
    """True when the segment is empty or ends with a newline (no torn last record)."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        if f.tell() == 0:
            return True
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def _read_complete(path: Path, warnings: list[str]) -> bytes:
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        line_no = data.count(b"\n", 0, cut) + 1
        warnings.append(f"{path}: line {line_no}: torn last line ({len(data) - cut} bytes) skipped; "
                        "the writer was stopped mid-record")
        data = data[:cut]
    return data


def _locate_bad_line(path: Path, data: bytes) -> str:
    for i, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            return f"{path}: line {i}: not valid JSON ({e.msg}); expected one JSON object per line"
        if not isinstance(obj, dict):
            return f"{path}: line {i}: expected a JSON object, got {type(obj).__name__}"
    return f"{path}: could not be read as JSON Lines"


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
    # Letting Arrow infer types and casting afterwards is ~1.5x faster than an explicit
    # schema (measured on 1M requests); Arrow promotes int -> double across blocks itself.
    ropts = pajson.ReadOptions(block_size=1 << 20)
    for seg in segments(folder, kind):
        if _ends_whole(seg):  # the usual case: Arrow reads the file itself, no copy in Python
            if seg.stat().st_size == 0:
                continue
            source, data = str(seg), None
        else:
            data = _read_complete(seg, warnings)
            if not data:
                continue
            source = pa.BufferReader(pa.py_buffer(data))
        try:
            table = pajson.read_json(source, read_options=ropts)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            data = data if data is not None else seg.read_bytes()
            msg = _locate_bad_line(seg, data)
            if msg.endswith("JSON Lines"):
                msg = f"{seg}: {str(e).splitlines()[0]}"
            raise InputError(msg) from None
        tables.append(_conform(table, schema, seg))
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables)


def _read_dicts(folder: Path, kind: str, warnings: list[str]) -> list[dict[str, Any]]:
    out = []
    for seg in segments(folder, kind):
        data = _read_complete(seg, warnings)
        for i, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise InputError(f"{seg}: line {i}: not valid JSON ({e.msg}); expected one JSON object per line") from None
            if not isinstance(obj, dict):
                raise InputError(f"{seg}: line {i}: expected a JSON object")
            out.append(obj)
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
    version = raw.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise InputError(f"{path}: field format_version: expected an integer <= {FORMAT_VERSION}, got {version!r}; "
                         "upgrade kvdoctor to read this capture")
    known = {f.name for f in dataclasses.fields(CaptureMeta)}
    kwargs = {k: v for k, v in raw.items() if k in known}
    kwargs["sources"] = {k: SourceStatus(**v) if isinstance(v, dict) else SourceStatus(ok=bool(v))
                         for k, v in (raw.get("sources") or {}).items()}
    return CaptureMeta(**kwargs)


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
