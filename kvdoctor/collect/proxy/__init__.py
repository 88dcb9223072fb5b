"""A streaming reverse proxy in front of any OpenAI-compatible server, recording one
:class:`~kvdoctor.model.RequestRecord` per completion request.

    server = await start_proxy("http://127.0.0.1:8080", sink, port=9000)
    ...  # point clients at http://127.0.0.1:9000 instead of :8080
    await server.close()

What it does:

* Every method and path goes to the upstream unchanged (``/health``, ``/metrics``,
  ``/v1/models`` ... work through the proxy); request and response bodies byte for byte,
  status and end-to-end headers unchanged. Hop-by-hop headers (Connection, Keep-Alive,
  Transfer-Encoding, TE, Trailer, Upgrade, Proxy-*, and those named in Connection) are
  dropped; compressed bodies stay compressed (no decompression on either side).
* Response bodies are forwarded chunk by chunk as they arrive, never buffered whole.
* ``POST /v1/chat/completions`` and ``POST /v1/completions`` are also analysed: arrival,
  first content chunk (TTFT), each later content chunk (ITL), finish, tokens from ``usage``
  or llama.cpp ``timings`` (``cache_n`` -> cached prompt tokens), conversation id, turn,
  prefix block hashes and output repetition (see :mod:`kvdoctor.collect.textstats`). No
  text is kept unless ``store_text``.
* Fail-open: an exception in the analysis is logged once per kind and that request's
  record is dropped; the bytes still flow. Upstream unreachable -> 502 with a short JSON
  error and ``sink.source_status("proxy", False, ...)`` once, ``True`` again on recovery.
* Stale keep-alive connections: llama.cpp closes the connection after every streamed
  response (and any used > 5 s); a request written on such a pooled connection before
  its FIN arrives gets no answer. Such a request (failed within ``RETRY_WITHIN_S``) is sent
  once more on a new connection, and after the first such event streamed responses' upstream
  connections are no longer pooled. Clients never see a spurious 502.

Overhead: on the critical path one write to the client and one clock read per upstream read
(however many events it holds); the events are analysed a batch at a time off that path, and
the request body after the response is complete.

The package: relay.py (the handler, retries, fail-open), eager.py (the response written from the
upstream's read callbacks), sse.py (the per-chunk annotation), record.py (the record built from
it) and http/ (its own HTTP/1.1 server and upstream client on llhttp). Nothing goes upstream
before llhttp has parsed the whole request.
"""
from .http import ProxyServer
from .record import client_request_id, traceparent_trace_id
from .record import ANALYSED_PATHS
from .relay import SOURCE_NAME, Relay, make_proxy, start_proxy
from .sse import MAX_ANALYSED_BODY, MAX_SSE_EVENT_BYTES, StreamAnnotator

__all__ = ["ANALYSED_PATHS", "MAX_ANALYSED_BODY", "MAX_SSE_EVENT_BYTES", "SOURCE_NAME", "ProxyServer", "Relay",
           "StreamAnnotator", "client_request_id", "make_proxy", "start_proxy", "traceparent_trace_id"]
