"""The /metrics scraper's up/down judgement: a refused connection is down at once; a server
that answers late (llama.cpp serves /metrics from the task loop a long prefill holds) is down
only after several timeouts in a row."""
from __future__ import annotations

import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil

from harness.llama_server import free_port
from kvdoctor.collect.base import SourceUnavailable
from kvdoctor.collect.scrape import DOWN_AFTER_TIMEOUTS, ScrapeCollector

from conftest import assert_process_ends, assert_runs_below_us

PAGE = b"# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"


class _Slow(BaseHTTPRequestHandler):
    delay_s = 0.0
    page = PAGE

    def do_GET(self):  # noqa: N802
        time.sleep(type(self).delay_s)
        page = type(self).page
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
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


VLLM_PAGE = (Path(__file__).parent / "data" / "metrics" / "vllm-0.32-cpu-under-load.prom").read_bytes()


def test_parse_in_a_worker_process_reads_what_the_thread_reads(caplog, monkeypatch):
    """`attach` parses each /metrics page in a worker process (~15 ms of Python a vLLM page,
    which in the scrape thread would hold the GIL the proxy relays with): the same sample, config
    and engine as parsing in the thread; the worker runs below the sidecar; a worker that dies
    costs no scrape (that page is parsed in the thread, the next in a new worker)."""
    handler = type("H", (_Slow,), {"delay_s": 0.0, "page": VLLM_PAGE})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    here, there = ScrapeCollector(url), ScrapeCollector(url, parse_in_process=True)
    import kvdoctor.collect.scrape as scrape

    monkeypatch.setattr(scrape, "PARSE_WAIT_S", 30.0)  # the worker's own parse, however slow its start
    try:
        a, b = here.collect(1000.0), there.collect(1000.0)
        assert a == b and a[-1].values and there.engine == here.engine == "vllm"
        worker = next(iter(there._parse_pool._processes))
        assert worker != os.getpid()
        assert_runs_below_us(worker)
        os.kill(worker, signal.SIGKILL)
        time.sleep(0.2)
        with caplog.at_level("WARNING"):
            c = there.collect(1001.0)
        assert c[-1].values == here.collect(1001.0)[-1].values
        assert any("parse worker failed" in r.getMessage() for r in caplog.records)
        there.collect(1002.0)
        assert next(iter(there._parse_pool._processes)) != worker
    finally:
        there.close()
        srv.shutdown()


def test_a_slow_parse_worker_costs_a_scrape_one_wait_and_a_stuck_one_is_ended(monkeypatch):
    """A worker that has not parsed a page within PARSE_WAIT_S (starved beside a busy engine, or
    still importing) costs that scrape one short wait: the page is parsed in the sidecar, and so is
    every page while the worker is busy (no scrape waits on it again, so the engine's gauges are
    not lost through an overload). A worker busy past PARSE_TIMEOUT_S is stuck: ended, not left
    running beside its replacement (a core and its memory held for as long as it is stuck)."""
    import kvdoctor.collect.scrape as scrape

    handler = type("H", (_Slow,), {"delay_s": 0.0, "page": VLLM_PAGE})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    c = ScrapeCollector(f"http://127.0.0.1:{srv.server_address[1]}", parse_in_process=True)
    monkeypatch.setattr(scrape, "PARSE_WAIT_S", 0.5)
    try:
        for _ in range(100):  # until the worker is up and answers in time
            assert c.collect(1000.0)[-1].values
            if c._parse_pool is not None and c._busy is None:
                break
            time.sleep(0.2)
        worker = next(iter(c._parse_pool._processes))
        c._parse_pool.submit(time.sleep, 120)  # the one worker is now stuck in a call
        t0 = time.monotonic()
        assert c.collect(1001.0)[-1].values  # parsed in the sidecar after one short wait
        assert c.collect(1002.0)[-1].values  # the worker is still busy: parsed here, no wait
        assert time.monotonic() - t0 < 0.5 + 0.4, "only the first scrape waited for the worker"
        assert psutil.pid_exists(worker), "a worker busy for less than PARSE_TIMEOUT_S is left to finish"
        monkeypatch.setattr(scrape, "PARSE_TIMEOUT_S", 0.3)
        time.sleep(0.4)
        assert c.collect(1003.0)[-1].values
        assert_process_ends(worker, 5.0, "stuck parse worker")
        assert c.collect(1004.0)[-1].values and next(iter(c._parse_pool._processes)) != worker
    finally:
        c.close()
        srv.shutdown()
