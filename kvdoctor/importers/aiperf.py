"""NVIDIA AIPerf's per-request records: ``profile_export.jsonl`` (ai-dynamo/aiperf).

One JSON object a line, nested::

    {"metadata": {"x_request_id": "...", "x_correlation_id": "...", "turn_index": 0,
                  "request_start_ns": 1759813207532900363, "request_end_ns": ..., "was_cancelled": false},
     "metrics": {"time_to_first_token": {"value": 255.9, "unit": "ms"}, "request_latency": {...},
                 "input_sequence_length": {"value": 550, "unit": "tokens"}, "output_sequence_length": {...},
                 "inter_chunk_latency": {"value": [4.9, 5.3, ...], "unit": "ms"}},
     "error": null | {"code": 499, "type": "RequestCancellationError", "message": "..."}}

Mapping: ``x_request_id`` -> request_id, ``x_correlation_id`` -> session_id (one user session),
``turn_index`` -> turn (1-based), ``request_start_ns`` (older AIPerf: ``timestamp_ns``) ->
arrival_s and ``request_end_ns`` (older: the ``max_response_timestamp`` metric) -> finish_s on
the Unix clock, ``time_to_first_token`` (older: ``ttft``) -> ttft_s, ``request_latency`` -> e2e_s,
``input_sequence_length`` (``error_isl`` on failures) -> prompt_tokens, ``output_sequence_length``
(reasoning tokens included: all decoded) -> output_tokens, ``inter_chunk_latency`` -> itl_s (gaps
between streamed chunks; ``--opt itl=false`` leaves them out). Every metric carries its unit and is
converted. ``error`` -> status/error/http_status through kvdoctor/error_classes.py: AIPerf marks
client cancellations with code 499 / ``RequestCancellationError`` (and ``was_cancelled``), which
become status "cancelled", not failures. Text is never kept.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from .. import error_classes
from ..capture.jsonl import json_lines
from ..errors import InputError
from ..model import CaptureMeta, RequestRecord, derive_request
from . import describe, integer, num, parse_options
from .base import Imported

NAME = "aiperf"
SUMMARY = "NVIDIA AIPerf profile_export.jsonl (per-request records: timings, tokens, errors, cancellations)"
GLOB = ("profile_export.jsonl", "*.jsonl")
OPTIONS = {"itl": "keep each request's inter-chunk latencies (default true)"}

_TIME_UNIT_S = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}


def _metric(metrics: dict[str, Any], where: str, *names: str, seconds: bool = False) -> Any:
    """The value of the first metric present, converted to seconds when ``seconds``."""
    for name in names:
        m = metrics.get(name)
        if m is None:
            continue
        if not isinstance(m, dict) or "value" not in m:
            raise InputError(f"{where}.metrics.{name}: expected {{\"value\": ..., \"unit\": ...}}, got {describe(m)}")
        v, unit = m["value"], m.get("unit")
        if not seconds:
            return v
        scale = _TIME_UNIT_S.get(str(unit))
        if scale is None:
            raise InputError(f"{where}.metrics.{name}.unit: expected one of ns, us, ms, s; got {describe(unit)}")
        if isinstance(v, list):
            return [num(x, f"{where}.metrics.{name}", allow_none=False) * scale for x in v]
        f = num(v, f"{where}.metrics.{name}")
        return None if f is None else f * scale
    return None


def _ns(v: Any, where: str) -> float | None:
    f = num(v, where)
    return None if f is None else f / 1e9


def _record(obj: Any, where: str, keep_itl: bool, fallback_id: str) -> RequestRecord:
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
        raise InputError(f"{where}: expected an AIPerf record with \"metadata\", \"metrics\" and \"error\"; "
                         f"got {describe(obj)}")
    md = obj["metadata"]
    metrics = obj.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise InputError(f"{where}.metrics: expected an object, got {describe(metrics)}")
    err = obj.get("error")
    if err is not None and not isinstance(err, dict):
        raise InputError(f"{where}.error: expected null or {{code, type, message}}, got {describe(err)}")

    arrival = _ns(md.get("request_start_ns", md.get("timestamp_ns")), f"{where}.metadata.request_start_ns")
    if arrival is None:
        arrival = _metric(metrics, where, "min_request_timestamp", seconds=True)
    finish = _ns(md.get("request_end_ns"), f"{where}.metadata.request_end_ns")
    if finish is None:
        finish = _metric(metrics, where, "max_response_timestamp", seconds=True)
    code = integer(err.get("code"), f"{where}.error.code") if err else None
    etype = str(err["type"]) if err and err.get("type") is not None else None
    message = str(err["message"]) if err and err.get("message") is not None else None
    if md.get("was_cancelled") is True:
        status, text = "cancelled", message or "cancelled by the client (AIPerf was_cancelled)"
    elif err:
        status = error_classes.record_status(None, code, message, etype) or "error"
        text = " ".join(x for x in (etype and f"{etype}:", message) if x) or f"error code {code}"
    else:
        status, text = "ok", None
    itl = _metric(metrics, where, "inter_chunk_latency", seconds=True) if keep_itl else None
    if itl is not None and not isinstance(itl, list):
        itl = None
    turn = integer(md.get("turn_index"), f"{where}.metadata.turn_index")
    rid = md.get("x_request_id")
    return derive_request(RequestRecord(
        request_id=str(rid) if rid else fallback_id,
        arrival_s=arrival,
        finish_s=finish if status == "ok" else None,
        ttft_s=_metric(metrics, where, "time_to_first_token", "ttft", seconds=True),
        e2e_s=_metric(metrics, where, "request_latency", seconds=True),
        itl_s=itl or None,
        prompt_tokens=integer(_metric(metrics, where, "input_sequence_length", "error_isl"), f"{where}: input_sequence_length"),
        output_tokens=integer(_metric(metrics, where, "output_sequence_length"), f"{where}: output_sequence_length"),
        session_id=str(md["x_correlation_id"]) if md.get("x_correlation_id") else None,
        turn=turn + 1 if turn is not None else None,
        status=status,
        error=text,
        http_status=code if code is not None and 100 <= code <= 599 else None,
    ))


def _lines(path: Path) -> Iterator[tuple[int, Any]]:
    return json_lines(path, "AIPerf's profile_export.jsonl (one record a line)")


def read(paths: list[Path], options: dict[str, Any]) -> Imported:
    opts = parse_options(NAME, options, {"itl": (bool, True)})
    it = _lines(paths[0])
    head = next(it, None)  # read now: a file of the wrong kind fails before anything is written
    if head and isinstance(head[1], dict) and "records" in head[1] and "metadata" not in head[1]:
        raise InputError(f"{paths[0]}: this is AIPerf's aggregate profile_export_aiperf.json; import the "
                         "per-request profile_export.jsonl written next to it")

    def records() -> Iterator[RequestRecord]:
        for k, path in enumerate(paths):
            rows = _chain(head, it) if k == 0 else _lines(path)
            prefix = f"{path.stem}/" if len(paths) > 1 else ""
            for n, obj in rows:
                rec = _record(obj, f"{path}: line {n}", opts["itl"], f"{prefix}{n}")
                if prefix:
                    rec = _with_id(rec, prefix + rec.request_id)
                yield rec

    md = head[1].get("metadata") if head and isinstance(head[1], dict) else None
    has_times = isinstance(md, dict) and bool(md.get("request_start_ns") or md.get("timestamp_ns"))
    notes = [] if has_times else ["no request_start_ns in the records: arrivals unknown, time-based views are unavailable"]
    meta = CaptureMeta(clock="unix", origin=f"import:{NAME}", arrivals_known=has_times)
    return Imported(meta=meta, records=records(), notes=notes)


def _chain(head, rest):
    if head is not None:
        yield head
    yield from rest


def _with_id(rec: RequestRecord, rid: str) -> RequestRecord:
    import dataclasses

    return dataclasses.replace(rec, request_id=rid)
