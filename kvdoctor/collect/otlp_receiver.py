"""OTLP/HTTP traces receiver: point vLLM's ``--otlp-traces-endpoint`` (with
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``) or SGLang's exporter at it.

``POST /v1/traces`` takes an ExportTraceServiceRequest as ``application/x-protobuf`` or as OTLP/JSON
(``application/json``), optionally ``Content-Encoding: gzip``, and answers per the OTLP/HTTP spec:
200 with an ExportTraceServiceResponse in the request's encoding (``partial_success`` counts spans
whose attributes had the wrong types), 400 with a google.rpc.Status for an undecodable body, 415 for
other content types or encodings. Each LLM request span (``llm_request``, or gen_ai.latency/usage
attributes) becomes a RequestRecord through the OTLP importer's mapping and goes to ``sink.emit``.
Binds 127.0.0.1 unless told otherwise: the receiver has no authentication.
"""
from __future__ import annotations

import asyncio
import logging
import zlib

import orjson
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from ..errors import InputError
from ..importers.otlp_json import (
    STATUS_ERROR,
    hex_ids_to_base64,
    any_value,
    is_llm_span,
    request_from_span_attributes,
)
from .base import Sink, SourceUnavailable

log = logging.getLogger(__name__)

NAME = "otlp"
PATH = "/v1/traces"
PROTOBUF, JSON = "application/x-protobuf", "application/json"
#: an export larger than these is refused with 413 (exporters batch far smaller: the OTel SDK
#: default is 512 spans a batch, well under 1 MiB); decoding runs in a worker thread
MAX_BODY_BYTES = 8 << 20
MAX_INFLATED_BYTES = 32 << 20
#: counters of one app: requests (POSTs), spans, records emitted, rejected spans, bad POSTs
STATS = web.AppKey("kvdoctor_otlp_stats", dict)
SINK = web.AppKey("kvdoctor_otlp_sink", object)


class _BadRequest(Exception):
    pass


class _TooLarge(Exception):
    pass


def _reply(status: int, msg: Message, content_type: str) -> web.Response:
    if content_type == JSON:
        body = json_format.MessageToJson(msg, indent=None).encode()
    else:
        body, content_type = msg.SerializeToString(), PROTOBUF
    return web.Response(status=status, body=body, content_type=content_type)


def _error(status: int, code: int, message: str, content_type: str) -> web.Response:
    return _reply(status, status_pb2.Status(code=code, message=message), content_type)


def _inflate(body: bytes, encoding: str) -> bytes:
    if encoding in ("identity", "") or (encoding == "gzip" and body[:2] != b"\x1f\x8b"):
        return body  # plain, or already inflated by an aiohttp server left at auto_decompress
    d = zlib.decompressobj(32 + zlib.MAX_WBITS)  # gzip or zlib header
    try:
        out = d.decompress(body, MAX_INFLATED_BYTES)
    except zlib.error as e:
        raise _BadRequest(f"body is not valid {encoding} ({e})") from None
    if d.unconsumed_tail:
        raise _TooLarge(f"body inflates to more than {MAX_INFLATED_BYTES >> 20} MiB")
    return out


def _inflate_decode(body: bytes, encoding: str, content_type: str) -> ExportTraceServiceRequest:
    return _decode(_inflate(body, encoding), content_type)


def _decode(body: bytes, content_type: str) -> ExportTraceServiceRequest:
    if content_type == PROTOBUF:
        msg = ExportTraceServiceRequest()
        try:
            msg.ParseFromString(body)
        except (DecodeError, ValueError) as e:
            raise _BadRequest(f"not an ExportTraceServiceRequest protobuf ({e})") from None
        return msg
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise _BadRequest(f"not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise _BadRequest(f"expected a JSON object with resourceSpans, got {type(obj).__name__}")
    try:
        hex_ids_to_base64(obj)
        return json_format.ParseDict(obj, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except (TypeError, AttributeError, ValueError) as e:  # resourceSpans of the wrong shape
        raise _BadRequest(f"not an OTLP/JSON ExportTraceServiceRequest ({type(e).__name__}: {str(e)[:120]})") from None
    except json_format.ParseError as e:
        raise _BadRequest(f"not an OTLP/JSON ExportTraceServiceRequest ({str(e).splitlines()[0]})") from None


def records_from_request(msg: ExportTraceServiceRequest, stats: dict[str, int]) -> tuple[list, list[str]]:
    """RequestRecords of the LLM request spans in one export, and one error line per rejected span."""
    records, errors = [], []
    for rs in msg.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                stats["spans"] += 1
                attrs = {kv.key: any_value(kv.value) for kv in span.attributes}
                if not is_llm_span(span.name, attrs):
                    continue
                err = (span.status.message or "span status ERROR") if span.status.code == STATUS_ERROR else None
                try:
                    records.append(request_from_span_attributes(
                        attrs, span.start_time_unix_nano or None, span.end_time_unix_nano or None,
                        fallback_id=bytes(span.span_id).hex() or None, error=err,
                        trace_id=bytes(span.trace_id).hex()))
                except InputError as e:
                    errors.append(f"span {span.name!r} {bytes(span.span_id).hex()}: {e}")
    return records, errors


async def _traces(request: web.Request) -> web.Response:
    stats, sink = request.app[STATS], request.app[SINK]
    stats["requests"] += 1
    content_type = request.content_type
    if content_type not in (PROTOBUF, JSON):
        stats["bad"] += 1
        return _error(415, code_pb2.INVALID_ARGUMENT,
                      f"unsupported Content-Type {content_type!r}; send {PROTOBUF} or {JSON}", PROTOBUF)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("identity", "gzip", "deflate", ""):
        stats["bad"] += 1
        return _error(415, code_pb2.INVALID_ARGUMENT, f"unsupported Content-Encoding {encoding!r}; use gzip",
                      content_type)
    declared = request.content_length
    if declared is not None and declared > MAX_BODY_BYTES:
        stats["bad"] += 1
        return _error(413, code_pb2.RESOURCE_EXHAUSTED,
                      f"export of {declared} bytes is over the {MAX_BODY_BYTES >> 20} MiB limit; send smaller batches",
                      content_type)
    try:
        raw = await request.read()
        # inflating and decoding a large export takes a while: not on the loop the proxy relays on
        msg = await asyncio.get_running_loop().run_in_executor(None, _inflate_decode, raw, encoding, content_type)
    except (web.HTTPRequestEntityTooLarge, _TooLarge) as e:
        stats["bad"] += 1
        text = str(e) if isinstance(e, _TooLarge) else f"export over the {MAX_BODY_BYTES >> 20} MiB limit"
        log.warning("OTLP receiver: 413 for a POST from %s: %s", request.remote, text)
        return _error(413, code_pb2.RESOURCE_EXHAUSTED, f"{text}; send smaller batches", content_type)
    except (web.RequestPayloadError, _BadRequest) as e:
        stats["bad"] += 1
        log.warning("OTLP receiver: 400 for a POST from %s: %s", request.remote, e)
        return _error(400, code_pb2.INVALID_ARGUMENT, str(e), content_type)
    records, errors = records_from_request(msg, stats)
    for rec in records:
        sink.emit(rec)
    stats["records"] += len(records)
    response = ExportTraceServiceResponse()
    if errors:
        stats["rejected"] += len(errors)
        log.warning("OTLP receiver: %d span(s) rejected, first: %s", len(errors), errors[0])
        response.partial_success.rejected_spans = len(errors)
        response.partial_success.error_message = "; ".join(errors[:3])
    return _reply(200, response, content_type)


def make_app(sink: Sink) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[SINK] = sink
    app[STATS] = {"requests": 0, "spans": 0, "records": 0, "rejected": 0, "bad": 0}
    app.router.add_post(PATH, _traces)
    return app


async def start_receiver(sink: Sink, host: str = "127.0.0.1", port: int = 4318) -> web.AppRunner:
    """Serve ``make_app(sink)`` on host:port (0 = any free port; ``runner.addresses`` tells which).
    Raises SourceUnavailable when the port cannot be bound. Stop with ``await runner.cleanup()``."""
    runner = web.AppRunner(make_app(sink), access_log=None, auto_decompress=False)  # 415 for unknown encodings
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        await runner.cleanup()
        raise SourceUnavailable(f"cannot listen for OTLP on {host}:{port}: {e.strerror or e}") from None
    bound = runner.addresses[0][1] if runner.addresses else port
    sink.source_status(NAME, True, f"OTLP/HTTP traces on http://{host}:{bound}{PATH}")
    return runner
