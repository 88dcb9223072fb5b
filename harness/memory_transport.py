"""An in-memory asyncio transport for driving the proxy's protocols without sockets
(``tests/test_proxy_eager.py``, ``benchmarks/bench_relay_legs.py``): keeps what is written, stamps
the first write (holding ``mark``), and with ``high_water`` tells its protocol to pause writing once
that many bytes wait unread (:meth:`MemoryTransport.drain`: the reader caught up)."""
from __future__ import annotations

import time
from typing import Any


class MemoryTransport:
    def __init__(self, protocol: Any = None, high_water: int | None = None, mark: bytes = b"",
                 keep: bool = True) -> None:
        self.protocol, self.high_water, self.mark, self.keep = protocol, high_water, mark, keep
        self.data = bytearray()
        self.unread = 0
        self.closing = False
        #: perf_counter() at the first write holding ``mark``
        self.first_write_s: float | None = None

    def write(self, data: bytes) -> None:
        if self.first_write_s is None and self.mark in data:
            self.first_write_s = time.perf_counter()
        if self.keep:
            self.data += data
        self.unread += len(data)
        if self.high_water is not None and self.unread > self.high_water and not self.protocol.write_paused:
            self.protocol.pause_writing()

    def writelines(self, parts: Any) -> None:
        self.write(b"".join(parts))

    def drain(self) -> None:
        self.unread = 0
        if self.protocol is not None and self.protocol.write_paused:
            self.protocol.resume_writing()

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default
