"""The proxy's per-request annotator: timestamps each upstream read as it is relayed.

:meth:`StreamAnnotator.feed` runs once per read on the relay's critical path: the caller took a
clock reading, and the read is kept with it. :meth:`StreamAnnotator.settle` analyses what was kept,
in batches off the per-read path: an incremental SSE split and one ``orjson.loads`` per event, the
first content event (TTFT), each later one (ITL; events of one read share its stamp),
``usage``/``timings``, the model and an error event. A non-SSE body is only kept (up to
:data:`MAX_ANALYSED_BODY`) for the record, which :func:`kvdoctor.collect.proxy.record.build_record`
builds after the response is complete.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import operator
import re
import time
from typing import Any

import orjson

from .. import textstats

#: most bytes of a non-SSE response body kept for its analysis (bigger: no analysis)
MAX_ANALYSED_BODY = 16 * 1024 * 1024
#: an SSE event still open past this many bytes is not analysed (the stream is still relayed)
MAX_SSE_EVENT_BYTES = 8 * 1024 * 1024
#: what sends an event down the event-by-event path: fields other than content (usage, llama.cpp
#: timings, an error, tool calls, reasoning, completion text) and the stream's end
_NOT_PLAIN = (b'"usage"', b'"timings"', b'"error"', b'"tool_calls":[', b'"reasoning_content":"', b'"text":"',
              b"[DONE]")
#: a non-empty string under a "content" key (inside a JSON string every quote is escaped, so this
#: is a key), and that string's JSON text
_CONTENT = re.compile(rb'"content":"(?:[^"\\]|\\.)')
_CONTENT_TEXT = re.compile(rb'"content":"((?:[^"\\]|\\.)+)"')
#: a stream's reads are analysed once this many bytes of them have gathered (and at its end): a
#: batch of ~70 events of an engine's ~230 bytes analysed in one go runs with the code and data in
#: the caches, where one event per read, between other processes' turns on the core, runs cold
#: (benchmarks/bench_relay_legs.py). Bounds what a stream holds: 1,024 streams, 16 MiB at most
SETTLE_BYTES = 16 * 1024


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
    """Per-request state. :meth:`feed` runs once per upstream read on the relay's hot path and only
    keeps the read with its timestamp; :meth:`settle` analyses what was kept, a batch at a time (the
    SSE split, one ``orjson.loads`` per event), when :data:`SETTLE_BYTES` have gathered, at
    :meth:`end`, and whenever a reader needs the state so far (``saw_done``, the in-flight view).
    A failure in the analysis is kept in :attr:`failed` (the record is then dropped, fail-open)."""

    __slots__ = ("_saw_done", "kind", "arrival_s", "store_text", "http_status", "sse", "first_s", "last_s",
                 "finish_s", "itl", "n_content", "usage", "timings", "model", "stream_error",
                 "rep", "out_parts", "_buf", "_crlf", "_body", "_body_len", "status",
                 "note", "client_id", "trace_id", "mono_to_wall_s", "_pending", "_stamps", "_pending_bytes", "failed")

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
        self._buf: bytes | bytearray = b""
        self._crlf = False
        self._body: list[bytes] | None = []
        self._body_len = 0
        #: reads kept by feed, not analysed yet, their timestamps (two lists: no tuple a read for the
        #: garbage collector to track) and their bytes
        self._pending: list[bytes] = []
        self._stamps: list[float] = []
        self._pending_bytes = 0
        #: the exception that ended the analysis (None: it goes on)
        self.failed: BaseException | None = None
        self._saw_done = False
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

    @property
    def saw_done(self) -> bool:
        """The stream's own end marker was relayed: a client leaving after it did not cancel."""
        self.settle()
        return self._saw_done

    # ---------------------------------------------------------------- response start
    def start(self, http_status: int, content_type: str) -> None:
        self.http_status = http_status
        self.sse = http_status < 300 and content_type.startswith("text/event-stream")
        if self.sse:
            self._body = None

    # ---------------------------------------------------------------- hot path
    def feed(self, chunk: bytes, now: float) -> None:
        """A read's bytes as relayed, stamped ``now``: kept for :meth:`settle` (a streamed response)."""
        if not self.sse:
            if self._body is not None:
                self._body_len += len(chunk)
                if self._body_len > MAX_ANALYSED_BODY:
                    self._body = None
                else:
                    self._body.append(chunk)
            return
        if self.failed is not None:
            return
        self._pending.append(chunk)
        self._stamps.append(now)
        self._pending_bytes += len(chunk)
        if self._pending_bytes >= SETTLE_BYTES:
            self.settle()

    # ---------------------------------------------------------------- off the hot path
    def first_seen_s(self) -> float | None:
        """The first token's stamp, or None before it; the kept reads are analysed only while it is
        unknown. The live view asks every stream in flight: a stream whose first token is known
        keeps its reads for its own batch instead of adding them to that one pass on the loop."""
        if self.first_s is None:
            self.settle()
        return self.first_s

    def settle(self) -> None:
        """Analyse the reads kept so far, in order; never raises (a failure is kept in ``failed``)."""
        chunks = self._pending
        if not chunks or self.failed is not None:
            return
        stamps = self._stamps
        self._pending, self._stamps, self._pending_bytes = [], [], 0
        try:
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self._crlf or b"\r" in data:  # CRLF line ends: the general path, read by read
                for chunk, now in zip(chunks, stamps):
                    self._split(chunk, now)
            else:
                self._batch(data, chunks, stamps)
        except Exception as e:  # noqa: BLE001 - the relay drops the record and says why (fail-open)
            self.failed = e
            self._buf = b""

    def _batch(self, data: bytes, chunks: list[bytes], stamps: list[float]) -> None:
        """The kept reads (``data``, joined) at once: split into events in C, each event stamped with
        the read its blank line came in; runs of the usual chat events (single-line ``data: {...}``
        with content and nothing else of note) analysed with no Python step per event
        (:meth:`_plain`), every other event (the first, naming the model; usage, timings, an error,
        tool calls, reasoning, [DONE], comments, a completions stream) one by one (:meth:`_event`)."""
        base = 0
        if self._buf:
            buf = self._buf
            if data.find(b"\n\n") < 0 and not (buf[-1:] == b"\n" and data[:1] == b"\n"):
                # still inside one event: it grows in place, linear however long it runs
                if not isinstance(buf, bytearray):
                    buf = self._buf = bytearray(buf)
                buf += data
                if len(buf) > MAX_SSE_EVENT_BYTES:
                    self._too_long()
                return
            base = len(buf)
            data = bytes(buf) + data
        events = data.split(b"\n\n")
        rest = events.pop()
        if len(rest) > MAX_SSE_EVENT_BYTES:
            self._too_long()
        self._buf = rest
        if not events:
            return
        if len(chunks) == 1:
            when = [stamps[0]] * len(events)
        else:  # the read holding each event's blank line (the offset of its second newline)
            ends = list(itertools.accumulate(map(len, chunks), initial=base))[1:]
            last_nl = map(operator.add, itertools.accumulate(map(len, events)), itertools.count(1, 2))
            when = list(map(stamps.__getitem__, map(bisect.bisect_right, itertools.repeat(ends), last_nl)))
        texts: list[str] = []
        i = 0
        while self.model is None and i < len(events):  # the stream's model first: its first event, mostly
            if events[i]:
                self._event(events[i], when[i], texts)
            i += 1
        if i < len(events) and self.kind == "chat" and self.model is not None:
            # runs of plain events at once; an event holding a field of another kind (the last one's
            # usage, llama.cpp's timings, [DONE]), and any run not plain after all, event by event
            starts = list(itertools.accumulate(map(operator.add, map(len, events), itertools.repeat(2)), initial=0))
            head = starts[-1]
            marks = {k: data.find(k, starts[i], head) for k in _NOT_PLAIN}
            while i < len(events):
                at = min((p for p in marks.values() if p >= 0), default=head)
                j = bisect.bisect_right(starts, at) - 1  # the event holding it (len(events): none)
                if j > i:
                    if texts:
                        self.rep.feed("".join(texts))
                        texts = []
                    if not self._plain(data, starts[i], starts[j], events[i:j], when[i:j]):
                        for k in range(i, j):
                            if events[k]:
                                self._event(events[k], when[k], texts)
                if j < len(events):
                    if events[j]:
                        self._event(events[j], when[j], texts)
                    for k, p in marks.items():
                        if 0 <= p < starts[j + 1]:
                            marks[k] = data.find(k, starts[j + 1], head)
                i = j + 1
        for ev, now in zip(events[i:], when[i:]):  # a completions stream, or no model named
            if ev:
                self._event(ev, now, texts)
        if texts:  # the repetition counter takes the text at once (words split across events too)
            self.rep.feed("".join(texts))

    def _plain(self, data: bytes, start: int, end: int, events: list[bytes], when: list[float]) -> bool:
        """``data[start:end]``, ``events``, when they are single-line ``data: {...}`` chat events
        (False, nothing done, when not): each must still be a JSON object (parsed, as every event is),
        and an event has content when a ``content`` key holds a non-empty string (inside a JSON string
        every quote is escaped: this is a key), its text that string's. No Python step per event."""
        n = len(events)
        if not (data.startswith(b"data: {", start) and data.count(b"\n\ndata: {", start, end) == n - 1
                and data.count(b"\n", start, end) == 2 * n):
            return False
        collections.deque(map(orjson.loads, data[start + 6:end - 2].split(b"\n\ndata: ")), maxlen=0)
        stamps = list(itertools.compress(when, map(_CONTENT.search, events)))
        if not stamps:
            return True
        texts = orjson.loads(b'["' + b'","'.join(_CONTENT_TEXT.findall(data, start, end)) + b'"]')
        self.rep.feed("".join(texts))
        if self.out_parts is not None:
            self.out_parts += texts
        self.n_content += len(stamps)
        if self.first_s is None:
            self.first_s = stamps[0]
        else:
            self.itl.append(stamps[0] - self.last_s)
        if len(stamps) > 1:
            self.itl += map(operator.sub, stamps[1:], stamps[:-1])
        self.last_s = stamps[-1]
        return True

    def _too_long(self) -> None:
        self._buf = b""
        raise ValueError(f"an SSE event over {MAX_SSE_EVENT_BYTES >> 20} MiB without its blank line: "
                         "this stream is relayed, not analysed")

    def _split(self, chunk: bytes, now: float) -> None:
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
        texts: list[str] = []
        while True:
            i = find(b"\n\n", max(start, scan))
            if i < 0:
                break
            if i > start:
                self._event(bytes(buf[start:i]), now, texts)
            start = i + 2
        if texts:  # the repetition counter takes the read's text at once (words split across events too)
            self.rep.feed("".join(texts))
        if start >= len(buf):
            self._buf = b""
        elif len(buf) - start > MAX_SSE_EVENT_BYTES:
            self._too_long()
        else:
            self._buf = buf[start:] if start else buf

    def _event(self, ev: bytes, now: float, texts: list[str]) -> None:
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
            self._saw_done = True
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
                    texts.append(t)
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
        self.settle()
        if self.sse and self.failed is None and self._buf.strip():
            rest, self._buf = self._buf.strip(), b""
            texts: list[str] = []
            try:  # a last event without its blank line; a truncated one is dropped
                self._event(bytes(rest), now, texts)
            except orjson.JSONDecodeError:
                pass
            if texts:
                self.rep.feed("".join(texts))

    def body(self) -> bytes | None:
        """The whole non-SSE response body, when it was kept (see :data:`MAX_ANALYSED_BODY`)."""
        if self.sse or not self._body:
            return None
        return b"".join(self._body)
