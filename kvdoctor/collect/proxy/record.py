"""The proxy's :class:`~kvdoctor.model.RequestRecord` for one completion request, built from its
:class:`~kvdoctor.collect.proxy.sse.StreamAnnotator` once the response is complete (off the
relay's critical path): outcome (through the one error classifier, :mod:`kvdoctor.error_classes`),
tokens from ``usage`` or llama.cpp ``timings``, latencies, and the prompt's conversation id, turn
and prefix block hashes (:mod:`kvdoctor.collect.textstats`).
"""
from __future__ import annotations

import os
import re
from typing import Any

import orjson

from ... import error_classes
from ...model import RequestRecord, derived_fields
from ...numeric import percentile_sorted
from .. import textstats
from .sse import StreamAnnotator, error_message

#: most characters of an error message kept in a record
ERROR_CHARS = 200

#: an id we keep verbatim: short, printable, no spaces (anything else gets a random id)
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
#: W3C trace context: version-traceid-parentid-flags, lower-case hex
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def client_request_id(value: str | None) -> str | None:
    """The client's ``X-Request-Id`` (the header vLLM and most gateways honour) when it is a
    plain token; ``None`` otherwise, so an odd header can never break a record."""
    if value and _CLIENT_ID.fullmatch(value):
        return value
    return None


def traceparent_trace_id(value: str | None) -> str | None:
    """The trace id of a valid ``traceparent`` header (the engine's span carries the same one)."""
    m = _TRACEPARENT.fullmatch((value or "").strip())
    if m is None or m.group(1) == "ff" or m.group(2) == "0" * 32:
        return None
    return m.group(2)


#: request paths whose POSTs are analysed, and their kind; a record's route is its kind's path
ANALYSED_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
ROUTES = {kind: path for path, kind in ANALYSED_PATHS.items()}


def build_record(an: StreamAnnotator, request_body: bytes, block_chars: int, server: str | None,
                 store_text: bool) -> RequestRecord:
    """The record of a finished request; ``request_body`` is the client's request as sent."""
    req = orjson.loads(request_body) if request_body else None
    if not isinstance(req, dict):
        req = None
    msgs = textstats.chat_messages(req)
    prompt = textstats.render_prompt(req)
    hashes = textstats.prefix_block_hashes(prompt, block_chars) if prompt else None
    error, err_type, out_text = _read_body(an)
    status, error = _outcome(an, error, err_type)
    prompt_tokens, output_tokens, cached = _tokens(an)
    tm = an.timings if isinstance(an.timings, dict) else {}

    arrival, finish = an.arrival_s, an.finish_s
    e2e = finish - arrival if finish is not None else None
    first, ttft = an.first_s, None
    if first is not None:
        ttft = first - arrival
    elif not an.sse and e2e is not None and status == "ok" and tm.get("predicted_ms") is not None:
        # non-streaming: the last token came at finish; decode took predicted_ms
        ttft = max(0.0, e2e - float(tm["predicted_ms"]) / 1000.0)
        first = arrival + ttft
    queue = None
    if ttft is not None and tm.get("prompt_ms") is not None:
        queue = max(0.0, ttft - float(tm["prompt_ms"]) / 1000.0)

    rep_value = an.rep.finish()  # None below one 4-gram
    if store_text and out_text is None and an.out_parts is not None:
        out_text = "".join(an.out_parts)

    model = an.model
    if model is None and req is not None and isinstance(req.get("model"), str):
        model = req["model"]
    prompt_chars = len(prompt) if prompt else None
    itl = [round(x, 6) for x in an.itl] if an.itl else None
    srt = sorted(itl) if itl else None
    kw = dict(
        request_id=an.client_id or os.urandom(8).hex(),
        arrival_s=arrival,
        first_token_s=first,
        finish_s=finish,
        ttft_s=ttft,
        itl_s=itl,
        itl_p50_s=percentile_sorted(srt, 50) if srt else None,
        itl_p99_s=percentile_sorted(srt, 99) if srt else None,
        itl_max_s=srt[-1] if srt else None,
        e2e_s=e2e,
        queue_s=queue,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens if status in ("ok", "cancelled", "error") else None,
        cached_prompt_tokens=cached,
        session_id=textstats.conversation_id(msgs),
        turn=textstats.turn_number(msgs),
        prefix_block_hashes=hashes or None,
        prefix_block_tokens=textstats.prefix_block_tokens(prompt_tokens, prompt_chars, block_chars)
        if hashes else None,
        status=status,
        error=error,
        http_status=an.http_status,
        model=model,
        server=server,
        trace_id=an.trace_id,
        route=ROUTES.get(an.kind),
        output_repetition=rep_value,
        prompt_text=prompt if store_text else None,
        output_text=out_text if store_text else None,
    )
    kw.update(derived_fields(kw.get))  # one record made, not made and then replaced
    return RequestRecord(**kw)


def _read_body(an: StreamAnnotator) -> tuple[str | None, str | None, str | None]:
    """(error message, error type, output text) of a non-streamed response body; like the
    stream's events, the body also gives the annotator its model, usage and timings."""
    raw = an.body()
    if raw is None:
        return None, None, None
    http_status = an.http_status
    failed = http_status is not None and http_status >= 400
    error = err_type = out_text = None
    try:
        obj: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return (raw[:ERROR_CHARS].decode("utf-8", "replace") if failed else None), None, None
    if isinstance(obj, dict):
        if an.model is None and isinstance(obj.get("model"), str):
            an.model = obj["model"]
        if obj.get("usage"):
            an.usage = obj["usage"]
        if obj.get("timings"):
            an.timings = obj["timings"]
        if obj.get("error") or failed:
            error = error_message(obj)
            e = obj.get("error", obj)
            if isinstance(e, dict) and isinstance(e.get("type"), str):
                err_type = e["type"]
        elif http_status is not None and http_status < 300:
            texts = []
            for c in obj.get("choices") or ():
                if not isinstance(c, dict):
                    continue
                m = c.get("message")
                t = m.get("content") if isinstance(m, dict) else c.get("text")
                if isinstance(t, str):
                    texts.append(t)
            out_text = "".join(texts)
            an.rep.feed(out_text)
    elif obj is not None and failed:
        error = error_message(obj)
    return error, err_type, out_text


def _outcome(an: StreamAnnotator, error: str | None, err_type: str | None) -> tuple[str, str | None]:
    """(capture status, error) from the HTTP status, the body's or stream's error and what the
    relay saw (a client that left, an upstream that broke)."""
    http_status = an.http_status
    status = "ok"
    if http_status is not None and http_status >= 400:
        status = "rejected" if _is_rejection(http_status, error, err_type) else "error"
        error = error or f"HTTP {http_status}"
    elif an.stream_error:
        status, error = "error", an.stream_error
    if an.status == "cancelled":
        status = "cancelled"
    elif an.status == "error":
        status = "error"
        error = an.note or error
    return status, (error[:ERROR_CHARS] if error else error)


def _is_rejection(http_status: int, message: str | None, err_type: str | None) -> bool:
    """The server or a gateway refused the request (429 rate limit, context too long, 503
    overloaded) rather than failing it: one classifier, kvdoctor/error_classes.py."""
    cls = error_classes.classify(http_status, err_type, message, status="error")
    return cls is not None and error_classes.CLASSES[cls].status == "rejected"


def _tokens(an: StreamAnnotator) -> tuple[int | None, int | None, int | None]:
    """(prompt, output, cached prompt) tokens from ``usage``, else llama.cpp ``timings``, else
    (output only) the content chunks counted."""
    u = an.usage if isinstance(an.usage, dict) else {}
    tm = an.timings if isinstance(an.timings, dict) else {}
    prompt_tokens = _int(u.get("prompt_tokens"))
    if prompt_tokens is None and tm.get("prompt_n") is not None:
        prompt_tokens = (_int(tm.get("prompt_n")) or 0) + (_int(tm.get("cache_n")) or 0)
    output_tokens = _int(u.get("completion_tokens"))
    if output_tokens is None:
        output_tokens = _int(tm.get("predicted_n"))
    if output_tokens is None and an.n_content:
        output_tokens = an.n_content
    cached = None
    ptd = u.get("prompt_tokens_details")
    if isinstance(ptd, dict):
        cached = _int(ptd.get("cached_tokens"))
    if cached is None:
        cached = _int(tm.get("cache_n"))
    return prompt_tokens, output_tokens, cached


def _int(x: Any) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return int(x)
    return None
