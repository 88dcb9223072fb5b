"""OTLP traces as JSON Lines, as the OpenTelemetry Collector's ``file`` exporter writes them.

Each line is an ExportTraceServiceRequest in OTLP/JSON (camelCase keys, int64 as strings, trace and
span ids as hex). Lines are parsed with protobuf's ``json_format`` into the opentelemetry-proto
classes. Spans from vLLM (``--otlp-traces-endpoint``; one ``llm_request`` span per finished request)
or SGLang carrying ``gen_ai.*`` attributes become requests; other spans are skipped.

Mapping (:func:`request_from_span_attributes`, shared with the live OTLP receiver):

* ``gen_ai.request.id`` -> request_id (the span id when absent)
* span start (the request's arrival in vLLM) -> arrival_s, Unix clock
* ``gen_ai.latency.time_to_first_token`` -> ttft_s, ``gen_ai.latency.e2e`` -> e2e_s,
  ``gen_ai.latency.time_in_queue`` -> queue_s, ``gen_ai.latency.time_in_model_prefill`` -> prefill_s,
  ``gen_ai.latency.time_in_model_decode`` -> decode_s (vLLM's scheduler clock: queued until
  scheduled, scheduled until the first token, first token until the last)
* ``gen_ai.latency.time_in_model_decode`` / (completion_tokens - 1) -> tpot_s
* ``gen_ai.usage.prompt_tokens`` -> prompt_tokens, ``gen_ai.usage.completion_tokens`` -> output_tokens
  (``gen_ai.usage.input_tokens``/``output_tokens``, the newer names, are read too)
* ``gen_ai.response.model`` -> model; span status ERROR -> status "error" with its message
* span end -> finish_s only when e2e is missing
"""
from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any, Iterator

from .. import error_classes
from ..capture.jsonl import loads_line, numbered
from ..errors import InputError
from ..model import CaptureMeta, RequestRecord, derive_request
from . import describe, parse_options
from .base import Imported

NAME = "otlp-json"
SUMMARY = "OTLP/JSON traces (OpenTelemetry Collector file exporter) with vLLM/SGLang llm_request spans"
GLOB = "*.json*"
OPTIONS: dict[str, str] = {}

A_REQUEST_ID = "gen_ai.request.id"
A_TTFT = "gen_ai.latency.time_to_first_token"
A_E2E = "gen_ai.latency.e2e"
A_QUEUE = "gen_ai.latency.time_in_queue"
A_PREFILL = "gen_ai.latency.time_in_model_prefill"
A_DECODE = "gen_ai.latency.time_in_model_decode"
A_PROMPT = ("gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens")
A_COMPLETION = ("gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens")
A_MODEL = ("gen_ai.response.model", "gen_ai.request.model")

STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


def _attr_num(attrs: dict[str, Any], key: str) -> float | None:
    v = attrs.get(key)
    if v is None:
        return None
    if isinstance(v, bool):
        raise InputError(f"attribute {key}: expected a number, got {describe(v)}")
    try:
        f = float(v)
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"attribute {key}: expected a number, got {describe(v)}") from None
    if f != f or f in (float("inf"), float("-inf")):  # a doubleValue of "Infinity" or "NaN" (protobuf JSON allows them)
        raise InputError(f"attribute {key}: expected a finite number, got {describe(v)}")
    return f


def _attr_int(attrs: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    """A count (tokens, an HTTP status): a whole number, not negative."""
    for key in keys:
        f = _attr_num(attrs, key)
        if f is not None:
            if f != int(f) or f < 0:
                raise InputError(f"attribute {key}: expected a whole number of 0 or more, got {describe(attrs[key])}")
            return int(f)
    return None


def request_from_span_attributes(attrs: dict[str, Any], start_unix_nano: int | None, end_unix_nano: int | None,
                                 *, fallback_id: str | None = None, error: str | None = None,
                                 trace_id: str | None = None) -> RequestRecord:
    """One request from a vLLM/SGLang ``llm_request`` span's attributes (plain key -> value dict).

    ``start_unix_nano`` is the span start (vLLM starts the span at the request's arrival);
    ``end_unix_nano`` is used for finish_s only when ``gen_ai.latency.e2e`` is missing.
    ``error`` (the span's ERROR status message) marks the request failed. Raises InputError naming
    the attribute when a value has the wrong type.
    """
    rid = attrs.get(A_REQUEST_ID)
    if rid is None or rid == "":
        rid = fallback_id if fallback_id is not None else (f"span-{start_unix_nano}" if start_unix_nano else None)
    if rid is None:
        raise InputError(f"span has no {A_REQUEST_ID} attribute and no start time to name it by")
    arrival = start_unix_nano / 1e9 if start_unix_nano else None
    e2e = _attr_num(attrs, A_E2E)
    out_tok = _attr_int(attrs, A_COMPLETION)
    decode = _attr_num(attrs, A_DECODE)
    tpot = decode / (out_tok - 1) if decode is not None and out_tok is not None and out_tok > 1 else None
    model = next((attrs[k] for k in A_MODEL if attrs.get(k)), None)
    # OTel semantic conventions: http.response.status_code (older http.status_code), error.type
    http = _attr_int(attrs, ("http.response.status_code", "http.status_code"))
    etype = attrs.get("error.type")
    etype = str(etype) if etype is not None else None
    failed = error is not None or etype is not None or (http is not None and http >= 400)
    if failed and error is None:
        error = etype or f"HTTP {http}"
    return derive_request(RequestRecord(
        request_id=str(rid),
        arrival_s=arrival,
        finish_s=end_unix_nano / 1e9 if e2e is None and end_unix_nano else None,
        ttft_s=_attr_num(attrs, A_TTFT),
        tpot_s=tpot,
        e2e_s=e2e,
        queue_s=_attr_num(attrs, A_QUEUE),
        prefill_s=_attr_num(attrs, A_PREFILL),
        decode_s=decode,
        prompt_tokens=_attr_int(attrs, A_PROMPT),
        output_tokens=out_tok,
        # one classifier for every format: a 499 or a cancelled span is not a server error
        status=error_classes.record_status(None, http, error, etype) if failed else None,
        error=(error or "span status ERROR") if failed else None,
        http_status=http,
        model=str(model) if model is not None else None,
        trace_id=trace_id or None,
    ))


def is_llm_span(name: str, attrs: dict[str, Any]) -> bool:
    return name == "llm_request" or any(k.startswith(("gen_ai.latency.", "gen_ai.usage.")) for k in attrs)


def any_value(v: Any) -> Any:
    """An opentelemetry.proto AnyValue as a plain Python value."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    x = getattr(v, kind)
    if kind == "array_value":
        return [any_value(e) for e in x.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in x.values}
    if kind == "bytes_value":
        return bytes(x).hex()
    return x


def hex_ids_to_base64(obj: Any) -> None:
    """OTLP/JSON writes ids as hex; protobuf's JSON mapping expects base64 for bytes fields."""
    def _list(x: Any) -> Any:  # a field of the wrong shape is left for ParseDict to name
        return x if isinstance(x, list) else ()

    for rs in _list(obj.get("resourceSpans")):
        if not isinstance(rs, dict):
            continue
        if "instrumentationLibrarySpans" in rs and "scopeSpans" not in rs:  # collectors before v0.60
            rs["scopeSpans"] = rs.pop("instrumentationLibrarySpans")
        for ss in _list(rs.get("scopeSpans")):
            if not isinstance(ss, dict):
                continue
            if "instrumentationLibrary" in ss and "scope" not in ss:
                ss["scope"] = ss.pop("instrumentationLibrary")
            for span in _list(ss.get("spans")):
                if not isinstance(span, dict):
                    continue
                items = [span, *(lk for lk in _list(span.get("links")) if isinstance(lk, dict))]
                for d in items:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        v = d.get(key)
                        if isinstance(v, str) and v and len(v) in (16, 32):
                            try:
                                d[key] = base64.b64encode(binascii.unhexlify(v)).decode()
                            except (binascii.Error, ValueError):
                                pass  # already base64


def _parse_line(path: Path, n: int, line: bytes):
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    where = f"{path}: line {n}"
    obj = loads_line(path, n, line, "one OTLP/JSON ExportTraceServiceRequest per line (the collector's file exporter)")
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object with resourceSpans, got {type(obj).__name__}")
    if "resourceSpans" not in obj:
        if any(k in obj for k in ("resourceMetrics", "resourceLogs")):
            return None  # another signal in the same file: nothing to import here
        raise InputError(f"{where}: no resourceSpans; expected an OTLP/JSON trace export "
                         f"(keys: {', '.join(sorted(obj)[:6])})")
    hex_ids_to_base64(obj)
    try:
        return json_format.ParseDict(obj, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except json_format.ParseError as e:
        raise InputError(f"{where}: not an OTLP ExportTraceServiceRequest ({str(e).splitlines()[0]})") from None


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    nonempty = list(numbered(data.splitlines()))
    # one pretty-printed export (e.g. a single request saved by hand) instead of JSON Lines
    if len(nonempty) > 1 and nonempty[0][1].strip() == b"{":
        yield 1, data
        return
    yield from nonempty


def _engine_of(scope_name: str) -> str | None:
    s = scope_name.lower()
    for engine in ("vllm", "sglang", "tensorrt", "trtllm", "tgi"):
        if engine in s:
            return "trtllm" if engine == "tensorrt" else engine
    return None


def _requests(path: Path, n: int, msg, seen: dict[str, Any]) -> Iterator[RequestRecord]:
    for rs in msg.resource_spans:
        for ss in rs.scope_spans:
            engine = _engine_of(ss.scope.name)
            for span in ss.spans:
                attrs = {kv.key: any_value(kv.value) for kv in span.attributes}
                if not is_llm_span(span.name, attrs):
                    seen["skipped"] += 1
                    continue
                if engine and not seen.get("engine"):
                    seen["engine"] = engine
                err = (span.status.message or "span status ERROR") if span.status.code == STATUS_ERROR else None
                try:
                    rec = request_from_span_attributes(
                        attrs, span.start_time_unix_nano or None, span.end_time_unix_nano or None,
                        fallback_id=bytes(span.span_id).hex() or None, error=err,
                        trace_id=bytes(span.trace_id).hex())
                except InputError as e:
                    raise InputError(f"{path}: line {n}: span {span.name!r}: {e}") from None
                seen["spans"] += 1
                if rec.model and not seen.get("model"):
                    seen["model"] = rec.model
                yield rec


def read(paths: list[Path], options: dict[str, Any]) -> Imported:
    parse_options(NAME, options, {})
    seen: dict[str, Any] = {"spans": 0, "skipped": 0}
    first_lines = _lines(paths[0])
    head = None
    for n, line in first_lines:  # parse up to the first trace line now: it names the engine and model
        msg = _parse_line(paths[0], n, line)
        if msg is not None:
            head = (n, msg)
            break
    engine = model = None
    if head is not None:
        for rs in head[1].resource_spans:
            for ss in rs.scope_spans:
                engine = engine or _engine_of(ss.scope.name)
                for span in ss.spans:
                    for kv in span.attributes:
                        if kv.key in A_MODEL and not model:
                            model = any_value(kv.value)

    def records() -> Iterator[RequestRecord]:
        for k, path in enumerate(paths):
            if k == 0:
                if head is not None:
                    yield from _requests(path, head[0], head[1], seen)
                it = first_lines
            else:
                it = _lines(path)
            for n, line in it:
                msg = _parse_line(path, n, line)
                if msg is not None:
                    yield from _requests(path, n, msg, seen)
        if not seen["spans"]:
            where = ", ".join(str(p) for p in paths)
            raise InputError(f"{where}: no LLM request spans (name llm_request or gen_ai.latency.*/gen_ai.usage.* "
                             f"attributes) among {seen['skipped']} spans; start vLLM with --otlp-traces-endpoint")

    meta = CaptureMeta(clock="unix", origin=f"import:{NAME}", engine=engine, model=model)
    return Imported(meta=meta, records=records(),
                    notes=["span start = request arrival (vLLM starts llm_request spans at arrival)"])
