"""Fast columnar load of a capture folder: meta.json checked field by field, each stream's
segments read crash-tolerantly (segment_reader), requests' derived columns filled (derived),
all into one :class:`Capture` (columns).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import orjson

from ..errors import InputError
from ..model import FORMAT_VERSION, CaptureMeta, SourceStatus
from .columns import SCHEMAS, Capture, Columns, EngineSeries, time_slice
from .derived import _derive, _engine_series
from .segment_index import TIME_FIELDS, overlaps, read_index
from .segment_reader import _read_table, read_dicts, read_segment_dicts, read_segment_table, segments


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


#: said on every output of an imported capture that names no engine (kvdoctor import --engine)
ENGINE_UNKNOWN = "engine unknown: fixes list every engine's knobs; pass --engine"


def load_warnings(meta: CaptureMeta, requests: Columns, engine: EngineSeries) -> list[str]:
    """What every output of this capture should say about the data itself: requests a client
    flagged that still completed (not failures, but their outputs were short), and an imported
    capture without an engine."""
    out = []
    n_flagged, n_short = client_flags(requests)
    if n_short:
        out.append(f"{n_short} request{'s' * (n_short != 1)} ended before max_tokens (flagged by the client, not "
                   "failures): throughput figures are per actual output")
    if n_flagged > n_short:
        n = n_flagged - n_short
        out.append(f"{n} completed request{'s' * (n != 1)} carry a note from the client (kept as their error text, "
                   "not counted as failures)")
    if (meta.origin or "").startswith("import:") and not meta.engine and not engine.engine:
        out.append(ENGINE_UNKNOWN)
    return out


def client_flags(requests: Columns) -> tuple[int, int]:
    """(completed requests with a client's note, of which "too few output tokens" flags)."""
    import numpy as np

    from .. import error_classes

    if not len(requests) or not requests.has("error"):
        return 0, 0
    status_codes, status_labels = requests.codes("status")
    ok = np.isin(status_codes, [i for i, x in enumerate(status_labels) if x == "ok"])
    codes, labels = requests.codes("error")
    flagged = ok & (codes >= 0)
    if not flagged.any():
        return 0, 0
    # judged as if the request had failed: only the text's own words ("too few tokens") make it a flag then
    short = [i for i, text in enumerate(labels) if text and error_classes.classify(text=text, status="error") == "client_flag"]
    return int(flagged.sum()), int((flagged & np.isin(codes, short)).sum())


_META_TYPES: dict[str, tuple[type, ...]] = {
    "created_unix_s": (int, float), "clock": (str,), "engine": (str,), "engine_version": (str,), "model": (str,), "gpu": (str,),
    "server": (str,), "origin": (str,), "config": (dict,), "text_stored": (bool,), "tool_version": (str,),
    "attribution": (str,),
}


#: the streams whose times make a capture's span (Capture.start_s/end_s); events do not
_SPAN_KINDS = ("requests", "gpu", "host", "engine")
_TABLE_KINDS = ("requests", "gpu", "host")


def load(path: str | Path, *, since_s: float | None = None, until_s: float | None = None,
         range_of: Callable[[float | None, float | None], tuple[float | None, float | None]] | None = None) -> Capture:
    """Load a capture folder. ``since_s``/``until_s`` keep records in that time range;
    ``range_of(start_s, end_s)`` gives the range from the capture's own span (relative times).
    With a range, only the segments that meet it are read (the writer's segment index)."""
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
    keep, read, lo, hi = None, {}, since_s, until_s
    if range_of is not None or lo is not None or hi is not None:
        keep, read, lo, hi = _segments_for_range(folder, warnings, since_s, until_s, range_of)
    requests = Columns(_derive(_read_table(folder, "requests", warnings, keep, read)))
    gpu = Columns(_read_table(folder, "gpu", warnings, keep, read))
    host = Columns(_read_table(folder, "host", warnings, keep, read))
    engine = _engine_series(read_dicts(folder, "engine", warnings, keep, read))
    events = read_dicts(folder, "events", warnings, keep, read)
    warnings += load_warnings(meta, requests, engine)
    cap = Capture(folder, meta, requests, gpu, host, engine, events, warnings)
    if lo is not None or hi is not None:
        cap = dataclasses.replace(time_slice(cap, lo, hi), range_s=(lo, hi))
    return cap


def _segments_for_range(folder: Path, warnings: list[str], lo: float | None, hi: float | None, range_of):
    """(which segments to read, those already read, the range). Segments the index does not vouch
    for are read first (whatever the range, they may hold records in it); with ``range_of``, the
    capture's span is the index's and theirs together."""
    index = read_index(folder)
    read: dict[Path, Any] = {}
    if range_of is not None:
        start, end = float("inf"), float("-inf")
        for kind in _SPAN_KINDS:
            for seg in segments(folder, kind):
                span = index.get(seg.name)
                if span is None:
                    got = read[seg] = (read_segment_table(seg, SCHEMAS[kind], warnings) if kind in _TABLE_KINDS
                                       else read_segment_dicts(seg, kind, warnings))
                    span = _span_of(got, kind)
                if span is not None:
                    start, end = min(start, span[0]), max(end, span[1])
        lo, hi = range_of(start if start <= end else None, end if start <= end else None)

    def keep(seg: Path) -> bool:
        span = index.get(seg.name)
        return span is None or overlaps(span, lo, hi)

    return keep, read, lo, hi


def _span_of(got, kind: str) -> tuple[float, float] | None:
    """(earliest, latest) time of a segment's records as read (a table, or engine records); a
    request's finish as the capture reads it (derived from arrival + E2E where not written)."""
    import numpy as np

    if got is None:
        return None
    if kind not in _TABLE_KINDS:
        ts = np.array([r["time_s"] for r in got if isinstance(r.get("time_s"), (int, float))], dtype=float)
    else:
        cols = Columns(_derive(got) if kind == "requests" else got)
        ts = np.concatenate([cols.num(name) for name in TIME_FIELDS])
    ts = ts[np.isfinite(ts)]
    return (float(ts.min()), float(ts.max())) if len(ts) else None
