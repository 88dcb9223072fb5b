"""Any CSV with one request a row; columns are mapped to request fields with ``--col FIELD=COLUMN``.

Examples::

    # AIBrix benchmark output (launch/finish are epoch seconds, ttft in seconds)
    kvdoctor import csv naive_output_4.1.csv -o cap/ --col arrival_s=launch_time \\
        --col finish_s=finish_time --col ttft_s=ttft --col prompt_tokens=prompt_tokens \\
        --col output_tokens=generation_tokens --col session_id=user_id
    # Azure LLM inference trace (TIMESTAMP is a date-time)
    kvdoctor import csv AzureLLMInferenceTrace_code.csv -o cap/ --col arrival_s=TIMESTAMP \\
        --col prompt_tokens=ContextTokens --col output_tokens=GeneratedTokens

Without any ``--col``, columns named exactly like a field (``ttft_s``, ``prompt_tokens``...) are used.

Instants (arrival_s, first_token_s, finish_s) may be numbers or ISO 8601 date-times. Numbers are
seconds, or epoch ms/us/ns recognised by size (``--opt time_unit=s|ms|us|ns`` to say so, e.g. for
relative milliseconds). Date-times without a zone are taken as UTC. The capture clock is "unix"
when instants are date-times or epoch numbers, "relative" otherwise (``--opt clock=`` overrides).
Durations (ttft_s, e2e_s, ...) are seconds unless ``--opt duration_unit=ms|us``. List fields
(itl_s, prefix_block_hashes) take a JSON list in the cell. The file is read in streamed blocks by
Arrow's CSV reader; an empty cell is a missing value.
"""
from __future__ import annotations

import csv as pycsv
import dataclasses
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from .. import error_classes
from ..errors import InputError
from ..model import CaptureMeta, RequestRecord, derive_request
from . import describe, parse_options, request_id_for
from .base import Imported

NAME = "csv"
SUMMARY = "any CSV, one request a row; map columns with --col FIELD=COLUMN (e.g. AIBrix, Azure LLM traces)"
GLOB = "*.csv"
OPTIONS = {
    "delimiter": "field separator (default ','; 'tab' for TSV)",
    "time_unit": "unit of numeric instants: auto (default: epoch s/ms/us/ns by size, else s), s, ms, us, ns",
    "duration_unit": "unit of duration columns: s (default), ms, us",
    "clock": "auto (default), unix or relative",
}

INSTANTS = ("arrival_s", "first_token_s", "finish_s")
_UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _field_kinds() -> dict[str, str]:
    kinds = {}
    for f in dataclasses.fields(RequestRecord):
        t = str(f.type)
        if f.name in ("prompt_text", "output_text"):
            continue  # text is only stored by an explicit --store-text capture
        if f.name in INSTANTS:
            kinds[f.name] = "instant"
        elif t.startswith("list[float]"):
            kinds[f.name] = "duration_list"
        elif t.startswith("list[int]"):
            kinds[f.name] = "int_list"
        elif t.startswith("int"):
            kinds[f.name] = "int"
        elif t.startswith("float"):
            kinds[f.name] = "duration" if f.name.endswith("_s") else "float"
        else:
            kinds[f.name] = "str"
    return kinds


FIELDS = _field_kinds()


def _header(path: Path, delimiter: str) -> list[str]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            row = next(pycsv.reader(f, delimiter=delimiter), None)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text; expected a CSV file") from None
    except pycsv.Error as e:  # a header field longer than the csv module's 131,072-character limit, a NUL byte
        raise InputError(f"{path}: line 1: {e}; expected a header row naming the columns") from None
    if not row:
        raise InputError(f"{path}: empty; expected a header row naming the columns")
    return [c.strip() for c in row]


def _bad_cell(path: Path, line: int, col: str, value: Any, expected: str) -> InputError:
    return InputError(f"{path}: line {line}, column {col!r}: expected {expected}, got {describe(value)}")


class _Column:
    """Converts one mapped column, block by block, remembering what it learnt (units, kind)."""

    def __init__(self, field: str, column: str, kind: str, opts: dict[str, Any]):
        self.field, self.column, self.kind = field, column, kind
        self.time_unit = None if opts["time_unit"] == "auto" else _UNIT[opts["time_unit"]]
        self.dur_scale = _UNIT[opts["duration_unit"]]
        self.saw_datetime = False
        self.saw_epoch = False

    def _floats(self, arr: pa.Array, path: Path, row0: int, expected: str) -> np.ndarray:
        try:
            out = pc.cast(arr, pa.float64())
            vals = out.to_numpy(zero_copy_only=False)
            return np.where(out.is_null().to_numpy(zero_copy_only=False), np.nan, vals)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
        res = np.full(len(arr), np.nan)
        for i, v in enumerate(arr.to_pylist()):
            if v is None:
                continue
            try:
                res[i] = float(v)
            except ValueError:
                raise _bad_cell(path, row0 + i + 2, self.column, v, expected) from None
        return res

    def _instants(self, arr: pa.Array, path: Path, row0: int) -> np.ndarray:
        try:
            return self._scale_numeric(pc.cast(arr, pa.float64()))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
        for tz in (None, "UTC"):
            try:
                ts = pc.cast(arr, pa.timestamp("us", tz=tz))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                continue
            self.saw_datetime = True
            us = pc.cast(ts, pa.int64())
            vals = us.to_numpy(zero_copy_only=False).astype(np.float64) / 1e6
            return np.where(us.is_null().to_numpy(zero_copy_only=False), np.nan, vals)
        res = np.full(len(arr), np.nan)  # mixed or unusual cells: one by one, and name the bad one
        for i, v in enumerate(arr.to_pylist()):
            if v is None:
                continue
            try:
                res[i] = self._scale_value(float(v))
                continue
            except ValueError:
                pass
            try:
                dt = datetime.fromisoformat(v.strip().replace(" UTC", "+00:00"))
            except ValueError:
                raise _bad_cell(path, row0 + i + 2, self.column, v,
                                "a number of seconds or an ISO 8601 date-time") from None
            if dt.tzinfo is None:
                dt = dt.replace(tzinfo=timezone.utc)
            self.saw_datetime = True
            res[i] = dt.timestamp()
        return res

    def _scale_numeric(self, out: pa.Array) -> np.ndarray:
        vals = out.to_numpy(zero_copy_only=False)
        vals = np.where(out.is_null().to_numpy(zero_copy_only=False), np.nan, vals)
        if self.time_unit is None:
            finite = vals[np.isfinite(vals)]
            if not len(finite):
                return vals
            self.time_unit = _guess_unit(float(np.abs(finite).max()))
        vals = vals * self.time_unit
        finite = vals[np.isfinite(vals)]
        if len(finite) and finite.min() >= 1e9:
            self.saw_epoch = True
        return vals

    def _scale_value(self, v: float) -> float:
        if self.time_unit is None:
            self.time_unit = _guess_unit(abs(v))
        v *= self.time_unit
        if v >= 1e9:
            self.saw_epoch = True
        return v

    def convert(self, arr: pa.Array, path: Path, row0: int) -> list[Any]:
        k = self.kind
        if k == "instant":
            return _nan_to_none(self._instants(arr, path, row0))
        if k in ("duration", "float"):
            vals = self._floats(arr, path, row0, "a number")
            return _nan_to_none(vals * self.dur_scale if k == "duration" else vals)
        if k == "int":
            vals = self._floats(arr, path, row0, "a whole number")
            bad = np.isfinite(vals) & (vals != np.round(vals))
            bad |= np.isinf(vals)
            if bad.any():
                i = int(np.argmax(bad))
                raise _bad_cell(path, row0 + i + 2, self.column, arr[i].as_py(), "a whole number")
            return [None if v != v else int(v) for v in vals.tolist()]
        if k == "str":
            return [None if v is None else str(v) for v in arr.to_pylist()]
        out: list[Any] = []
        for i, v in enumerate(arr.to_pylist()):
            if v is None:
                out.append(None)
                continue
            expected = "a JSON list of numbers like [0.02, 0.03]" if k == "duration_list" else \
                "a JSON list of integers like [1, 2, 3]"
            try:
                lst = orjson.loads(v)
            except orjson.JSONDecodeError:
                raise _bad_cell(path, row0 + i + 2, self.column, v, expected) from None
            ok = isinstance(lst, list) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and (k == "duration_list" or isinstance(x, int))
                for x in lst)
            if not ok:
                raise _bad_cell(path, row0 + i + 2, self.column, v, expected)
            out.append([x * self.dur_scale for x in lst] if k == "duration_list" else lst)
        return out


def _guess_unit(magnitude: float) -> float:
    """Epoch ns/us/ms are recognised by size (1.7e18 / 1.7e15 / 1.7e12); anything smaller is seconds."""
    if magnitude >= 1e17:
        return 1e-9
    if magnitude >= 1e14:
        return 1e-6
    if magnitude >= 1e11:
        return 1e-3
    return 1.0


def _nan_to_none(vals: np.ndarray) -> list[float | None]:
    return [None if v != v else v for v in vals.tolist()]


def _blocks(path: Path, cols: list[_Column], delimiter: str) -> Iterator[tuple[int, dict[str, list[Any]]]]:
    """(first row index, field -> values) per block of the file."""
    names = list(dict.fromkeys(c.column for c in cols))
    try:
        reader = pacsv.open_csv(
            path,
            read_options=pacsv.ReadOptions(block_size=4 << 20),
            parse_options=pacsv.ParseOptions(delimiter=delimiter),
            convert_options=pacsv.ConvertOptions(include_columns=names, column_types={n: pa.string() for n in names},
                                                 strings_can_be_null=True, quoted_strings_can_be_null=True),
        )
    except pa.ArrowInvalid as e:
        raise InputError(f"{path}: {_arrow_msg(e, path, delimiter)}") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e})") from None
    row0 = 0
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowInvalid as e:
            raise InputError(f"{path}: {_arrow_msg(e, path, delimiter)}") from None
        n = batch.num_rows
        if not n:
            continue
        out = {}
        for c in cols:
            arr = batch.column(batch.schema.get_field_index(c.column))
            out[c.field] = c.convert(arr, path, row0)
        yield row0, out
        row0 += n


def _arrow_msg(e: Exception, path: Path, delimiter: str) -> str:
    msg = str(e).splitlines()[0]
    if "Expected" in msg and "columns" in msg:
        where = _ragged_line(path, delimiter)
        if where:
            return where
        msg += "; every row must have as many fields as the header"
    return msg


def _ragged_line(path: Path, delimiter: str) -> str | None:
    """Where the first row with the wrong number of fields is (Arrow's message has no line)."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = pycsv.reader(f, delimiter=delimiter)
            width = len(next(reader, []))
            for row in reader:
                if row and len(row) != width:
                    return (f"line {reader.line_num}: {len(row)} fields where the header has {width}; "
                            "every row must have as many fields as the header")
    except (OSError, UnicodeDecodeError, pycsv.Error):
        return None
    return None


def _short_header(header: list[str], limit: int = 200) -> str:
    s = ", ".join(header)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def read(paths: list[Path], options: dict[str, Any]) -> Imported:
    options = dict(options or {})
    mapping: dict[str, str] = dict(options.pop("columns", None) or {})
    opts = parse_options(NAME, options, {"delimiter": (str, ","), "time_unit": (str, "auto"),
                                         "duration_unit": (str, "s"), "clock": (str, "auto")})
    delim = {"tab": "\t", "\\t": "\t", "comma": ",", "semicolon": ";"}.get(opts["delimiter"], opts["delimiter"])
    if len(delim) != 1:
        raise InputError(f"--opt delimiter={opts['delimiter']}: expected one character (or 'tab')")
    for key, allowed in (("time_unit", ("auto", *_UNIT)), ("duration_unit", ("s", "ms", "us")),
                         ("clock", ("auto", "unix", "relative"))):
        if opts[key] not in allowed:
            raise InputError(f"--opt {key}={opts[key]}: expected one of {', '.join(allowed)}")
    for field in mapping:
        if field not in FIELDS:
            raise InputError(f"--col {field}={mapping[field]}: unknown field {field!r}; valid fields: {', '.join(FIELDS)}")

    headers = {p: _header(p, delim) for p in paths}
    if not mapping:
        mapping = {f: f for f in FIELDS if f in headers[paths[0]]}
        if not mapping:
            raise InputError(f"{paths[0]}: no --col FIELD=COLUMN given and no column is named like a field; "
                             f"header: {_short_header(headers[paths[0]])}; fields: {', '.join(FIELDS)}")
    for p, header in headers.items():
        for field, col in mapping.items():
            if col not in header:
                raise InputError(f"{p}: no column {col!r} (for --col {field}={col}); header: {_short_header(header)}")

    cols = [_Column(f, c, FIELDS[f], opts) for f, c in mapping.items()]
    first = _blocks(paths[0], cols, delim)
    head = next(first, None)  # read the first block now: it fixes units and the clock
    instants = [c for c in cols if c.kind == "instant"]
    if opts["clock"] != "auto":
        clock = opts["clock"]
    elif any(c.saw_datetime or c.saw_epoch for c in instants):
        clock = "unix"
    else:
        clock = "relative"

    def records() -> Iterator[RequestRecord]:
        for n, path in enumerate(paths):
            it = _chain(head, first) if n == 0 else _blocks(path, cols, delim)
            stem = path.stem
            for row0, data in it:
                fields = list(data)
                columns = [data[f] for f in fields]
                for j, values in enumerate(zip(*columns)):
                    kw = {f: v for f, v in zip(fields, values) if v is not None}
                    if kw.get("request_id") is None:
                        kw["request_id"] = request_id_for(len(paths), stem, row0 + j)
                    st = error_classes.record_status(kw.get("status"), kw.get("http_status"), kw.get("error"))
                    if st is not None:
                        kw["status"] = st
                    yield derive_request(RequestRecord(**kw))

    notes = []
    if not instants:
        notes.append("no arrival/finish column mapped: request times unknown, time-based views are unavailable")
    if any(c.saw_datetime for c in instants):
        notes.append("date-times without a zone are read as UTC")
    meta = CaptureMeta(clock=clock, origin=f"import:{NAME}", arrivals_known=bool(instants))
    return Imported(meta=meta, records=records(), notes=notes)


def _chain(head, rest):
    if head is not None:
        yield head
    yield from rest
