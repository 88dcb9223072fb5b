"""Fast columnar load of a capture folder: meta.json checked field by field, each stream's
segments read crash-tolerantly (segment_reader), requests' derived columns filled (derived),
all into one :class:`Capture` (columns).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson

from ..errors import InputError
from ..model import FORMAT_VERSION, CaptureMeta, SourceStatus
from .columns import Capture, Columns, EngineSeries, time_slice
from .derived import _derive, _engine_series
from .segment_reader import _read_table, read_dicts


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
    engine = _engine_series(read_dicts(folder, "engine", warnings))
    events = read_dicts(folder, "events", warnings)
    warnings += load_warnings(meta, requests, engine)
    cap = Capture(folder, meta, requests, gpu, host, engine, events, warnings)
    if since_s is not None or until_s is not None:
        cap = time_slice(cap, since_s, until_s)
    return cap
