"""The /metrics scraper's up/down judgement: a refused connection is down at once; a server
that answers late (llama.cpp serves /metrics from the task loop a long prefill holds) is down
only after several timeouts in a row."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvdoctor.collect.base import SourceUnavailable
from kvdoctor.collect.scrape import DOWN_AFTER_TIMEOUTS, ScrapeCollector
from kvdoctor.testing.llama_server import free_port

PAGE = b"# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"


class _Slow(BaseHTTPRequestHandler):
    delay_s = 0.0

    def do_GET(self):  # noqa: N802
        time.sleep(type(self).delay_s)
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(PAGE)))
            self.end_headers()
            self.wfile.write(PAGE)
        except OSError:
            pass

    def log_message(self, *a):
        pass


def _kinds(c: ScrapeCollector) -> list[str]:
    try:
        out = c.collect(time.time())
    except SourceUnavailable as e:
        out = e.records
    return [getattr(r, "kind", "sample") for r in out]


def test_slow_answers_are_not_a_server_down_until_they_repeat():
    handler = type("H", (_Slow,), {"delay_s": 0.0})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        c = ScrapeCollector(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=0.2)
        assert "sample" in _kinds(c)
        handler.delay_s = 0.6  # busy: every scrape times out
        seen = [_kinds(c) for _ in range(DOWN_AFTER_TIMEOUTS)]
        assert seen[:-1] == [[]] * (DOWN_AFTER_TIMEOUTS - 1) and seen[-1] == ["server-down"]
        handler.delay_s = 0.0
        time.sleep(0.7)
        assert _kinds(c)[:1] == ["server-up"]
        handler.delay_s = 0.6  # one slow answer after that is not an outage either
        assert _kinds(c) == []
    finally:
        srv.shutdown()


def test_refused_connection_is_down_at_once():
    c = ScrapeCollector(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    assert _kinds(c) == ["server-down"]
    assert _kinds(c) == []  # said once
