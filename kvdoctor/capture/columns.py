"""The columnar Capture: Arrow tables behind cached numpy views, the engine series, and the
schemas every stream is read into (declared once, on the record dataclasses in kvdoctor.model)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..model import CaptureMeta, GpuSample, HostSample, RequestRecord

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
                # Arrow writes NaN for a null float itself (no mask pass of ours)
                arr = col.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
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
    #: the --since/--until range this capture was cut to, as people read it (the
    #: nothing-to-diagnose reason names it); None for a whole capture
    range_text: str | None = None
    #: the (since, until) epoch seconds it was cut to (either may be None); None for a whole capture
    range_s: tuple[float | None, float | None] | None = None

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
