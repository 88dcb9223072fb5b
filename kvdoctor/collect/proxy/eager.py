"""The relay's work on a response done in the upstream's read callbacks while nothing makes it
wait: the response head and each body chunk are written to the client (and fed to the request's
annotator) as llhttp parses them, instead of waking the handler's task for each.

Why: waking the task costs a loop turn and a coroutine resume, ~40 us with the caches cold, between
the first token's arrival and its write to the client (measured: ``benchmarks/bench_relay_legs.py``).

The handler's task still owns the exchange: it starts the head itself if this did not (the answer
came before the task was waiting, or the client was gone), writes whatever was queued, awaits the
client's back-pressure, ends the reply and emits the record. This switches off for good, leaving
every later chunk queued for the task in order, once the client's buffer is full (only the task may
wait for it to drain), the client is gone, or anything fails.
"""
from __future__ import annotations

from typing import Any, Callable

from .http import Reply
from .sse import StreamAnnotator


class EagerRelay:
    """The hook an upstream :class:`~kvdoctor.collect.proxy.http.Response` calls: ``head(r)``
    once its final head is parsed, ``body(r, chunks)`` once per read with the body chunks parsed
    from it (True: written here, not queued). A read's chunks go to the client as one write and to
    the annotator with one timestamp, as a client reading them at once sees them.
    ``an`` is the request's annotator (None once analysis failed: the task reads it from here)."""

    __slots__ = ("reply", "an", "_head_only", "_end_to_end", "_fail", "started", "on")

    def __init__(self, reply: Reply, an: StreamAnnotator | None, head_only: bool,
                 end_to_end: Callable[[Any], list[tuple[bytes, bytes]]],
                 fail: Callable[[StreamAnnotator | None, str, BaseException], None]) -> None:
        self.reply = reply
        self.an = an
        self._head_only = head_only
        self._end_to_end = end_to_end
        self._fail = fail
        #: the head went to the client from here
        self.started = False
        #: body chunks are written here as they come
        self.on = False

    def start(self, up: Any) -> None:
        """Start the reply with the upstream's head (and the analysis with its status); raises
        ConnectionError when the client is gone. From :meth:`head`, or from the task if not."""
        an = self.an
        if an is not None:
            try:
                an.start(up.status, up.content_type)
            except Exception as e:  # noqa: BLE001 - analysis never stands in the way of traffic
                self._fail(an, "start", e)
                self.an = None
        self.reply.start(up.status, up.reason, self._end_to_end(up.headers))
        self.started = True

    def head(self, up: Any) -> None:
        try:
            self.start(up)
        except Exception:  # noqa: BLE001 - the client left (or worse): the task starts it and sees why
            return
        self.on = not self._head_only

    def body(self, up: Any, chunks: list[bytes]) -> bool:
        if not self.on:
            return False
        an = self.an
        now = an.now() if an is not None else 0.0
        chunk = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:
            self.reply.write_now(chunk)
        except Exception:  # noqa: BLE001 - not written (the client left): the task tries and sees why
            self.on = False
            return False
        if self.reply.write_paused:
            self.on = False  # the client reads slower than the upstream sends: the task waits for it
        self.feed(chunk, now)
        return True

    def feed(self, chunk: bytes, now: float) -> None:
        """Analyse a chunk written to the client (here or by the task); a failure ends the analysis."""
        an = self.an
        if an is not None:
            try:
                an.feed(chunk, now)
            except Exception as e:  # noqa: BLE001 - analysis never stands in the way of traffic
                self._fail(an, "feed", e)
                self.an = None
