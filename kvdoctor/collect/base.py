"""The interface every live source implements.

Polled sources (NVML, host, engine scrape) are a one-method protocol: ``collect(now_s)``
returns the records read at that instant, or raises :class:`SourceUnavailable` saying why
(the agent records that once in the capture's meta and the log, and goes on with the rest).
Push sources (the streaming proxy, the OTLP receiver) are handed a :class:`Sink` and call
``emit`` for each record as it completes.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class SourceUnavailable(Exception):
    """The source cannot read (no driver, no GPU, server down); the message says why.

    ``records`` are what the source did learn on the way (e.g. a server-down event): the agent
    keeps them."""

    def __init__(self, detail: str, records: list[Any] | tuple[Any, ...] = ()):
        super().__init__(detail)
        self.records = list(records)


@runtime_checkable
class PolledCollector(Protocol):
    name: str
    interval_s: float

    def collect(self, now_s: float) -> list[Any]: ...


class Sink(Protocol):
    def emit(self, record: Any) -> None: ...

    def source_status(self, name: str, ok: bool, detail: str = "") -> None: ...


class ListSink:
    """A sink that keeps what it is given: for tests and for library users."""

    def __init__(self) -> None:
        self.records: list[Any] = []
        self.status: dict[str, tuple[bool, str]] = {}

    def emit(self, record: Any) -> None:
        self.records.append(record)

    def source_status(self, name: str, ok: bool, detail: str = "") -> None:
        self.status[name] = (ok, detail)
