"""The proxy's per-request annotator: timestamps each upstream chunk as it is relayed.

:meth:`StreamAnnotator.feed` runs once per chunk on the relay's critical path: a clock read was
taken by the caller, then an incremental SSE split and one ``orjson.loads`` per event. It notes
the first content chunk (TTFT), each later one (ITL), ``usage``/``timings``, the model and an
error event; a non-SSE body is only kept (up to :data:`MAX_ANALYSED_BODY`) for the record,
which :func:`kvdoctor.collect.proxy.record.build_record` builds after the response is complete.
"""
from __future__ import annotations

import time
from typing import Any

import orjson

from .. import textstats

#: most bytes of a non-SSE response body kept for its analysis (bigger: no analysis)
MAX_ANALYSED_BODY = 16 * 1024 * 1024
#: an SSE event still open past this many bytes is not analysed (the stream is still relayed)
MAX_SSE_EVENT_BYTES = 8 * 1024 * 1024


def error_message(obj: Any) -> str | None:
    """The message of an OpenAI/llama.cpp/vLLM error body or SSE error object."""
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            for k in ("message", "detail", "msg"):
                v = err.get(k)
                if isinstance(v, str):
                    return v
            return orjson.dumps(err).decode()
        if isinstance(err, str):
            return err
        if "detail" in obj:
            return str(obj["detail"])
    if obj is None:
        return None
    return str(obj)


class StreamAnnotator:
    """Per-request state; :meth:`feed` runs once per upstream chunk (the hot path)."""

    __slots__ = ("saw_done", "kind", "arrival_s", "store_text", "http_status", "sse", "first_s", "last_s",
                 "finish_s", "itl", "n_content", "usage", "timings", "model", "stream_error",
                 "rep", "out_parts", "_buf", "_crlf", "_body", "_body_len", "status",
                 "note", "client_id", "trace_id", "mono_to_wall_s")

    def __init__(self, kind: str, arrival_s: float, store_text: bool, arrival_mono_s: float | None = None) -> None:
        self.kind = kind
        self.arrival_s = arrival_s
        #: the request's stamps are its wall-clock arrival plus monotonic time since: a wall-clock
        #: step while it runs (NTP, a VM paused and resumed) cannot bend its TTFT, ITL or e2e
        self.mono_to_wall_s = arrival_s - (time.perf_counter() if arrival_mono_s is None else arrival_mono_s)
        self.store_text = store_text
        self.http_status: int | None = None
        self.sse = False
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.finish_s: float | None = None
        self.itl: list[float] = []
        self.n_content = 0
        self.usage: dict | None = None
        self.timings: dict | None = None
        self.model: str | None = None
        self.stream_error: str | None = None
        self.rep = textstats.RepetitionCounter(4)
        self.out_parts: list[str] | None = [] if store_text else None
        self._buf = b""
        self._crlf = False
        self._body: list[bytes] | None = []
        self._body_len = 0
        #: the stream's own end marker was relayed: a client leaving after it did not cancel
        self.saw_done = False
        #: set by the handler: "cancelled" (client left), "error" (upstream broke)
        self.status: str | None = None
        self.note: str | None = None
        #: the client's own id for the request (X-Request-Id), kept so records join the client's logs
        self.client_id: str | None = None
        #: the trace id of the client's W3C traceparent: joins the record to the engine's span
        self.trace_id: str | None = None

    def now(self) -> float:
        """Wall-clock seconds on this request's clock (see ``mono_to_wall_s``)."""
        return time.perf_counter() + self.mono_to_wall_s

    # ---------------------------------------------------------------- response start
    def start(self, http_status: int, content_type: str) -> None:
        self.http_status = http_status
        self.sse = http_status < 300 and content_type.startswith("text/event-stream")
        if self.sse:
            self._body = None

    # ---------------------------------------------------------------- hot path
    def feed(self, chunk: bytes, now: float) -> None:
        if not self.sse:
            if self._body is not None:
                self._body_len += len(chunk)
                if self._body_len > MAX_ANALYSED_BODY:
                    self._body = None
                else:
                    self._body.append(chunk)
            return
        if self._crlf or b"\r" in chunk:
            self._crlf = True
            if chunk[:1] == b"\n" and self._buf[-1:] == b"\r":  # a CRLF split across chunks
                self._buf = self._buf[:-1]
            chunk = chunk.replace(b"\r\n", b"\n")
        # only the new bytes (and the one before them) are searched, and a pending partial
        # event grows in place: linear in the stream, however long an event runs
        if self._buf:
            scan = len(self._buf) - 1
            if not isinstance(self._buf, bytearray):
                self._buf = bytearray(self._buf)
            self._buf += chunk
            buf = self._buf
        else:
            scan, buf = 0, chunk
        start = 0
        find = buf.find
        while True:
            i = find(b"\n\n", max(start, scan))
            if i < 0:
                break
            if i > start:
                self._event(bytes(buf[start:i]), now)
            start = i + 2
        if start >= len(buf):
            self._buf = b""
        elif len(buf) - start > MAX_SSE_EVENT_BYTES:
            self._buf = b""
            raise ValueError(f"an SSE event over {MAX_SSE_EVENT_BYTES >> 20} MiB without its blank line: "
                             "this stream is relayed, not analysed")
        else:
            self._buf = buf[start:] if start else buf

    def _event(self, ev: bytes, now: float) -> None:
        if ev.startswith(b"data: ") and b"\n" not in ev:
            payload = ev[6:]
            field = b"data"
        else:  # general SSE: several lines, comments, other fields
            datas, field = [], b"data"
            for line in ev.split(b"\n"):
                if line.startswith(b"data:"):
                    datas.append(line[5:].lstrip(b" "))
                elif line.startswith(b"error:"):
                    datas.append(line[6:].lstrip(b" "))
                    field = b"error"
            if not datas:
                return
            payload = b"\n".join(datas)
        if payload[:6] == b"[DONE]":
            self.saw_done = True
            return
        obj = orjson.loads(payload)
        if not isinstance(obj, dict):
            return
        if field == b"error" or obj.get("error"):
            self.stream_error = error_message(obj) or "error event in stream"
            return
        if self.model is None:
            self.model = obj.get("model")
        choices = obj.get("choices")
        if choices:
            content = False
            for c in choices:
                d = c.get("delta")
                if d is not None:  # chat: text in delta.content; reasoning or tool calls count too
                    t = d.get("content")
                    if not t and (d.get("reasoning_content") or d.get("tool_calls")):
                        content = True
                        continue
                else:  # completions
                    t = c.get("text")
                if t:
                    content = True
                    self.rep.feed(t)
                    if self.out_parts is not None:
                        self.out_parts.append(t)
            if content:
                self.n_content += 1
                if self.first_s is None:
                    self.first_s = now
                else:
                    self.itl.append(now - self.last_s)
                self.last_s = now
        u = obj.get("usage")
        if u:
            self.usage = u
        tm = obj.get("timings")
        if tm:
            self.timings = tm

    def end(self, now: float) -> None:
        self.finish_s = now
        if self.sse and self._buf.strip():
            rest, self._buf = self._buf.strip(), b""
            try:  # a last event without its blank line; a truncated one is dropped
                self._event(rest, now)
            except orjson.JSONDecodeError:
                pass

    def body(self) -> bytes | None:
        """The whole non-SSE response body, when it was kept (see :data:`MAX_ANALYSED_BODY`)."""
        if self.sse or not self._body:
            return None
        return b"".join(self._body)
