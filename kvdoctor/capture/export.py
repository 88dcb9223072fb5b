"""A capture's records as a table for pandas, DuckDB or a spreadsheet."""
from __future__ import annotations

import io
from typing import BinaryIO

import orjson
import pyarrow as pa
import pyarrow.csv as pacsv

from ..errors import InputError
from .reader import Capture

WHAT = ("requests", "gpu", "host", "engine", "events")
FORMATS = ("csv", "jsonl", "parquet")


def table(cap: Capture, what: str) -> pa.Table:
    if what == "requests":
        return cap.requests.table
    if what in ("gpu", "host"):
        return getattr(cap, what).table
    if what == "engine":
        cols = {"time_s": pa.array(cap.engine.time_s), "server": pa.array(cap.engine.servers, pa.string())}
        cols.update({k: pa.array(v) for k, v in sorted(cap.engine.values.items())})
        return pa.table(cols)
    if what == "events":
        return pa.table({"time_s": [e.get("time_s") for e in cap.events], "kind": [e.get("kind") for e in cap.events],
                         "server": [e.get("server") for e in cap.events],
                         "detail": [orjson.dumps(e.get("detail") or {}).decode() for e in cap.events]})
    raise InputError(f"--what {what!r}: expected one of {', '.join(WHAT)}")


def write(tab: pa.Table, fmt: str, out: BinaryIO) -> None:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(tab, out)
    elif fmt == "csv":
        # lists (ITL gaps, prefix hashes) do not fit a CSV cell: write them as JSON text
        cols = [pa.array([None if v is None else orjson.dumps(v).decode() for v in c.to_pylist()], pa.string())
                if pa.types.is_list(c.type) else c for c in tab.columns]
        pacsv.write_csv(pa.table(cols, names=tab.column_names), out)
    elif fmt == "jsonl":
        buf = io.BytesIO()
        for row in tab.to_pylist():
            buf.write(orjson.dumps({k: v for k, v in row.items() if v is not None}) + b"\n")
        out.write(buf.getvalue())
    else:
        raise InputError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
