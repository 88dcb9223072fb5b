"""What a failed request's status, error type and text say about *why* it failed: the one
error classifier (the proxy, every importer and the signals all use it).

Each class names who is at fault and what to change, because the fixes differ completely:
a 429 from a gateway quota is not solved by the server's ``--max-model-len``, a client that
gave up is not a server error, and a benchmark client's "too few output tokens" flag is a
completed request. Text is matched on word boundaries ("bloom" is not "oom", "Rate limit"
is not a KV-cache message).

(``kvdoctor/errors.py`` holds the exceptions kvdoctor itself raises; this is about the
served requests' errors.)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class ErrorClass:
    name: str
    #: counts as a failed request (error_rate, errors); False for cancellations and client flags
    failure: bool
    #: the status an importer or the proxy records for it
    status: str
    #: why it happens, and who can change it
    cause: str
    fix: str


CLASSES: dict[str, ErrorClass] = {c.name: c for c in (
    ErrorClass("rate_limited", True, "rejected",
               "a rate limit or quota in front of the model (HTTP 429): the client's plan, a gateway or the "
               "provider refused the request before it reached the engine",
               "raise the quota at the gateway/provider, or slow the client (fewer concurrent requests, "
               "retry with backoff); the server's own settings are not the cause"),
    ErrorClass("context_overflow", True, "rejected",
               "prompt + requested output longer than the context the server allows a request",
               "truncate or summarise prompts and cap max_tokens at the client, or give requests more context "
               "(vLLM --max-model-len, SGLang --context-length, TGI --max-total-tokens, llama.cpp -c / --parallel)"),
    ErrorClass("kv_exhausted", True, "error",
               "the KV cache or GPU memory ran out for the sequences in flight",
               "admit only what fits: fewer concurrent sequences (--max-num-seqs, --max-running-requests, "
               "--parallel), more KV memory or fewer bytes per token (fp8 KV)"),
    ErrorClass("overloaded", True, "rejected",
               "the server or its gateway shed load (HTTP 503, queue full, no free slot)",
               "add capacity or admit less: more replicas, a bounded queue with client backoff"),
    ErrorClass("timeout", True, "error",
               "the request ran past a timeout (HTTP 408/504 or a client/gateway deadline)",
               "find what made it slow (queueing, long prefills) before raising the timeout"),
    ErrorClass("invalid_request", True, "error",
               "the server refused the request as malformed or unauthorised (HTTP 4xx)",
               "fix the client's request (model name, parameters, credentials)"),
    ErrorClass("server_error", True, "error",
               "the server failed while serving (HTTP 5xx, a broken stream, no connection)",
               "read the server's log around these times (crash, restart, exception)"),
    ErrorClass("cancelled", False, "cancelled",
               "the client cancelled or disconnected (HTTP 499): not a server failure",
               "none on the server; check the client's timeout if cancellations were not intended"),
    ErrorClass("client_flag", False, "ok",
               "the benchmark client flagged a completed request (e.g. llmperf 'too few output tokens': the "
               "model stopped before the requested length); the server answered",
               "none on the server; set the client's expected output length or ignore_eos if exact lengths matter"),
)}

_W = re.IGNORECASE
#: (class, pattern) tried in order; all word-bounded
_TEXT: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("cancelled", re.compile(r"\b(cancell?ed|cancellation|client (closed|disconnected))\b", _W)),
    ("rate_limited", re.compile(r"\b(rate[ _-]?limit(s|ed)?|ratelimit|too many requests|quota|throttl(ed|ing))\b", _W)),
    ("client_flag", re.compile(r"\b(output|generated) too few tokens\b|\btoo few (output )?tokens\b", _W)),
    # vLLM "maximum context length is 4096 tokens", SGLang "longer than the model's context length",
    # llama.cpp "exceeds the available context size", OpenAI context_length_exceeded,
    # TGI "`inputs` tokens + `max_new_tokens` must be <= 4096"
    ("context_overflow", re.compile(
        r"\b(context[ _](length|size|window)|max(imum)?[ _]context|max_model_len|context_length_exceeded|"
        r"prompt is too long|input is too long|too many (input |prompt )?tokens|max_total_tokens|"
        r"max_input_tokens|inputs?`? tokens \+ `?max_new_tokens)\b", _W)),
    ("kv_exhausted", re.compile(
        r"\b(out of memory|oom|cuda error: out of memory|outofmemoryerror|kv[ -]?cache (is )?(full|exhausted)|"
        r"no (free|available) (kv )?(blocks?|cache)|insufficient (kv|memory)|"
        r"(failed to find|could not find) (free space in the )?kv)\b", _W)),
    ("overloaded", re.compile(r"\b(overloaded|server (is )?busy|queue (is )?full|no (free |available )?slots?( available)?|"
                              r"service unavailable)\b", _W)),
    ("timeout", re.compile(r"\b(time[d ]? ?out|timeout(error)?|deadline exceeded)\b", _W)),
)
_TYPES = {"ratelimiterror": "rate_limited", "rate_limit_error": "rate_limited", "rate_limit_exceeded": "rate_limited",
          "requestcancellationerror": "cancelled", "cancellederror": "cancelled",
          "context_length_exceeded": "context_overflow", "exceed_context_size_error": "context_overflow",
          "timeouterror": "timeout", "outofmemoryerror": "kv_exhausted"}
# generic types (vLLM's BadRequestError, OpenAI's invalid_request_error) say nothing on their
# own: the text and the HTTP status decide


def classify(http_status: int | float | None = None, error_type: str | None = None, text: str | None = None,
             status: str | None = None) -> str | None:
    """The class of one request's outcome, or None for a plain success.

    ``status`` is the capture's status when known ("ok", "error", "rejected", "cancelled");
    a request with status "ok" and no error text is a success whatever else is set.
    """
    code = _code(http_status)
    return _classify(code, (error_type or "").strip(), (text or "").strip(), status or "")


def get(name: str | None) -> ErrorClass | None:
    return CLASSES.get(name) if name else None


def status_for(http_status: int | float | None = None, error_type: str | None = None,
               text: str | None = None) -> tuple[str, str | None]:
    """(capture status, class) for a request whose outcome is described by these; ("ok", None)
    when nothing says it failed. Importers use this so every format maps errors alike."""
    cls = classify(http_status, error_type, text, status="error" if (error_type or text or _failed_code(http_status)) else "ok")
    return (CLASSES[cls].status if cls else "ok"), cls


def record_status(status: str | None, http_status: int | float | None, error: str | None,
                  error_type: str | None = None) -> str | None:
    """The capture status for a record an importer read: an explicit "ok" stays (a client's note
    on a completed request does not make it fail); otherwise the class decides, so a 499 is
    "cancelled" and a 429 "rejected" in every format. None when nothing is known."""
    if status == "ok" or status == "in-flight":
        return status
    if status is None and not error and not error_type and not _failed_code(http_status):
        return None if http_status is None else "ok"
    cls = classify(http_status, error_type, error, status or "error")
    return CLASSES[cls].status if cls else (status or "ok")


def _code(v: int | float | None) -> int | None:
    try:
        f = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return int(f) if f == f else None


def _failed_code(v) -> bool:
    c = _code(v)
    return c is not None and (c >= 400 or c < 0)


@lru_cache(maxsize=4096)
def _classify(code: int | None, etype: str, text: str, status: str) -> str | None:
    if status == "cancelled" or code == 499:
        return "cancelled"
    if status in ("ok", "in-flight") and not text and not etype:
        return None
    if code == 429:
        return "rate_limited"
    by_type = _TYPES.get(re.sub(r"[^a-z_]", "", etype.lower()))
    if by_type:
        return by_type
    blob = f"{etype} {text}"
    for name, pat in _TEXT:
        if pat.search(blob):
            return name
    if status == "ok" and (code is None or code < 400):
        return "client_flag"  # a note on a completed request (a client-side check)
    if code is not None:
        if code in (408, 504):
            return "timeout"
        if code == 503:
            return "overloaded"
        if 400 <= code < 500:
            return "invalid_request"
    return "server_error"
