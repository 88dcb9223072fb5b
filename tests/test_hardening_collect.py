"""Hardening of the sidecar's collection (issue 14, points 3, 4 and part of 6): odd values from
a real HTTP server never kill the scrape loop; a /metrics that drips, never ends or is huge is
cut off by a total deadline or a size limit; SIGTERM always ends the process within seconds."""
from __future__ import annotations

import asyncio
import gzip
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager

import pytest

import kvdoctor
from harness.llama_server import free_port
from kvdoctor.sidecar.agent import Agent, AttachConfig
from kvdoctor.collect.base import SourceUnavailable
from kvdoctor.collect.scrape import MAX_BODY_BYTES, ScrapeCollector

from conftest import assert_process_ends, assert_runs_below_us

LLAMA_PAGE = b"# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n" \
             b"# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 10\n"
VLLM_PAGE = (b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 1\n"
             b"# TYPE vllm:cache_config_info gauge\n"
             b"vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"123456789012345678901234\"} 1\n")


class RawServer:
    """A loopback HTTP server answering each path with a function of the socket: it can answer
    properly, drip, stall, or send a huge body, as a misbehaving engine would."""

    def __init__(self, routes):
        self.routes = routes
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            path = head.split(b" ", 2)[1].decode()
            self.routes.get(path, not_found)(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self):
        self._stop = True
        self.sock.close()


def ok(body: bytes, ctype=b"text/plain"):
    def answer(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    return answer


def not_found(conn):
    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def drip_body(conn):
    """Headers at once, then one byte of body every 0.1 s, for ever: every read is on time."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n")
    while True:
        conn.sendall(b"#")
        time.sleep(0.1)


def drip_headers(conn):
    for b in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100000:
        conn.sendall(bytes([b]))
        time.sleep(0.1)


def huge_declared(conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 157286400\r\n\r\n" + b"#" * 65536)
    time.sleep(5)


def huge_chunked(conn):
    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    line = b"# " + b"x" * 65000 + b"\n"
    for _ in range(MAX_BODY_BYTES // len(line) + 10):
        conn.sendall(b"%x\r\n" % len(line) + line + b"\r\n")
    conn.sendall(b"0\r\n\r\n")


@contextmanager
def raw_server(routes):
    srv = RawServer(routes)
    try:
        yield srv
    finally:
        srv.close()


# -- 4. deadlines -------------------------------------------------------------------------------
@pytest.mark.parametrize("route", [drip_body, drip_headers], ids=["body", "headers"])
def test_a_dripping_metrics_page_is_cut_at_the_total_deadline(route):
    with raw_server({"/metrics": route}) as srv:
        c = ScrapeCollector(srv.url, timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(SourceUnavailable, match="timed out"):
            c.collect(time.time())
        assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("route", [huge_declared, huge_chunked], ids=["declared", "chunked"])
def test_an_oversized_metrics_page_is_refused_and_the_server_stays_up(route):
    with raw_server({"/metrics": route}) as srv:
        c = ScrapeCollector(srv.url, timeout_s=10)
        with pytest.raises(SourceUnavailable, match="MiB limit") as e:
            c.collect(time.time())
        assert not any(getattr(r, "kind", "") == "server-down" for r in e.value.records)


def _wait_http(url, timeout_s=20.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer")


def test_sigterm_ends_attach_within_seconds_while_a_scrape_drips(tmp_path):
    with raw_server({"/metrics": drip_body, "/props": drip_body}) as srv:
        listen = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "kvdoctor", "attach", "--server", srv.url, "--capture",
                                 str(tmp_path / "cap"), "--listen", f"127.0.0.1:{listen}", "--gpu", "none",
                                 "--scrape-interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_http(f"http://127.0.0.1:{listen}/healthz")
            time.sleep(1.0)  # a scrape is now blocked mid-drip
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=15)
            took = time.monotonic() - t0
        finally:
            proc.kill()
        assert proc.returncode == 0, err[-2000:]
        assert took < 6.0, f"took {took:.1f} s to exit after SIGTERM"
        assert "capture closed" in err
        assert kvdoctor.load(tmp_path / "cap").warnings == []


# -- 3. the loop never dies ------------------------------------------------------------------------
@contextmanager
def running_agent(cfg: AttachConfig):
    agent = Agent(cfg)
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=lambda: loop.run_until_complete(agent.run()), daemon=True)
    t.start()
    try:
        yield agent
    finally:
        loop.call_soon_threadsafe(agent.stop)
        t.join(15)
        assert not t.is_alive(), "the agent did not stop"


def _scrapes_keep_coming(agent: Agent, api: str) -> dict:
    first = _wait_http(f"{api}/healthz")
    time.sleep(1.0)
    later = _wait_http(f"{api}/healthz")
    assert later["records"]["engine"] > first["records"]["engine"] + 3, (first, later)
    return later


@pytest.mark.parametrize("routes", [
    {"/metrics": ok(VLLM_PAGE)},
    {"/metrics": ok(LLAMA_PAGE), "/props": ok(b'{"default_generation_settings": {"n_ctx": 1e300}, "total_slots": 1}',
                                             b"application/json")},
    {"/metrics": ok(LLAMA_PAGE), "/props": ok(b'{"default_generation_settings": {"n_ctx": "lots"}, "total_slots": {}}',
                                             b"application/json")},
], ids=["24-digit-label", "props-1e300", "props-wrong-types"])
def test_odd_values_never_stop_the_scrape_loop(tmp_path, routes):
    with raw_server(routes) as srv:
        listen = free_port()
        cfg = AttachConfig(server_url=srv.url, capture_dir=tmp_path / "cap", listen=f"127.0.0.1:{listen}",
                           collectors=[ScrapeCollector(srv.url, interval_s=0.05, timeout_s=1.0)])
        with running_agent(cfg) as agent:
            health = _scrapes_keep_coming(agent, f"http://127.0.0.1:{listen}")
            assert health["sources"]["scrape"]["ok"] is True
    cap = kvdoctor.load(tmp_path / "cap")
    assert cap.warnings == [] and len(cap.engine.time_s) > 3


def test_status_changes_while_the_capture_cannot_be_written(tmp_path):
    """The server flips between answering and 500 while the capture folder is read-only: every
    status change fails to reach meta.json; the loop goes on, /healthz says degraded."""
    from test_hardening_capture import small_tmpfs

    flip = {"n": 0}

    def flapping(conn):
        flip["n"] += 1
        if flip["n"] % 2:
            ok(LLAMA_PAGE)(conn)
        else:
            conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    with raw_server({"/metrics": flapping}) as srv, small_tmpfs(tmp_path / "fs", "1m") as fs:
        (fs / "cap").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        listen = free_port()
        cfg = AttachConfig(server_url=srv.url, capture_dir=fs / "cap", listen=f"127.0.0.1:{listen}",
                           collectors=[ScrapeCollector(srv.url, interval_s=0.05, timeout_s=1.0)])
        with running_agent(cfg) as agent:
            api = f"http://127.0.0.1:{listen}"
            first = _wait_http(f"{api}/healthz")
            time.sleep(1.0)
            later = _wait_http(f"{api}/healthz")
            assert flip["n"] > 6  # scrapes go on through every status change
            assert later["status"] == "degraded" and "Read-only" in later["capture_error"]
            assert later["capture_dropped"]["engine"] > first["capture_dropped"].get("engine", 0)
        assert agent.capture_problem() and "could not be written" in agent.capture_problem()


def test_a_failing_collector_is_counted_logged_once_and_retried(tmp_path, caplog):
    class Broken:
        name, interval_s, calls = "broken", 0.05, 0

        def collect(self, now_s):
            type(self).calls += 1
            raise KeyError("a bug")

    listen = free_port()
    cfg = AttachConfig(server_url="http://127.0.0.1:9", capture_dir=tmp_path / "cap", listen=f"127.0.0.1:{listen}",
                       collectors=[Broken()])
    with caplog.at_level("ERROR"), running_agent(cfg):
        time.sleep(0.8)
        health = _wait_http(f"http://127.0.0.1:{listen}/healthz")
        with urllib.request.urlopen(f"http://127.0.0.1:{listen}/metrics") as r:
            metrics = r.read().decode()
    assert Broken.calls > 5 and health["errors"]["broken"]["count"] >= 5
    assert health["sources"]["broken"]["ok"] is False and "KeyError" in health["errors"]["broken"]["last"]
    assert 'kvdoctor_collector_errors_total{source="broken"}' in metrics
    assert sum("a bug" in r.getMessage() for r in caplog.records) == 1


# -- 7. /report off the loop, cached per capture size and for a while ------------------------------
def test_report_is_rendered_off_the_loop_once_per_capture_size(tmp_path):
    from kvdoctor.model import RequestRecord

    listen = free_port()
    cfg = AttachConfig(server_url="http://127.0.0.1:9", capture_dir=tmp_path / "cap", listen=f"127.0.0.1:{listen}")
    with running_agent(cfg) as agent:
        api = f"http://127.0.0.1:{listen}"
        _wait_http(f"{api}/healthz")
        for i in range(20):
            agent.writer.write(RequestRecord(request_id=str(i), arrival_s=time.time() - 20 + i, ttft_s=0.1, e2e_s=1.0,
                                             output_tokens=10))
        pages = []
        for _ in range(3):
            with urllib.request.urlopen(f"{api}/report", timeout=60) as r:
                pages.append(r.read())
                assert int(r.headers["Content-Length"]) == len(pages[-1])  # written in slices, framed whole
        assert agent.report.reports_rendered == 1 and pages[0] == pages[1] == pages[2] and b"<html" in pages[0].lower()
        # the render process yields the cores to the relay and the engine when they are busy
        assert_runs_below_us(next(iter(agent.report._render_pool._processes)))
        # a browser (or anything that accepts gzip) gets the page compressed in the render process,
        # so the loop writes ~1.5 MB of ready bytes instead of encoding ~5 MB of text per request
        req = urllib.request.Request(f"{api}/report", headers={"Accept-Encoding": "gzip, deflate"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.headers["Content-Encoding"] == "gzip" and "charset=utf-8" in r.headers["Content-Type"]
            assert gzip.decompress(r.read()) == pages[0]
        # new records within the reuse window: the page is reused (steady traffic adds records
        # every request; a dashboard polling every second must not keep a core rendering)
        agent.writer.write(RequestRecord(request_id="new", arrival_s=time.time(), ttft_s=0.1))
        with urllib.request.urlopen(f"{api}/report", timeout=60) as r:
            assert r.read() == pages[0]
        assert agent.report.reports_rendered == 1
        # past the window, new records get a new page
        agent.report.report_reuse_s = 0.0
        with urllib.request.urlopen(f"{api}/report", timeout=60) as r:
            r.read()
        assert agent.report.reports_rendered == 2


# -- fault suite: signals at random points ---------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_signals_at_random_points_leave_a_readable_capture(tmp_path, sig):
    """attach with the proxy under traffic, stopped at random instants (start-up included):
    SIGTERM exits 0 within seconds; either way the capture loads with at most torn last lines."""
    import random

    from harness.loadgen import run_load, short_prompts

    rng = random.Random(14)
    sse = (b'data: {"choices":[{"delta":{"content":"hi "}}]}\n\n' * 5) + b"data: [DONE]\n\n"
    with raw_server({"/v1/chat/completions": ok(sse, b"text/event-stream"), "/metrics": ok(LLAMA_PAGE)}) as srv:
        for k in range(3):
            cap, pport = tmp_path / f"cap{k}", free_port()
            proc = subprocess.Popen([sys.executable, "-m", "kvdoctor", "attach", "--server", srv.url, "--capture",
                                     str(cap), "--listen", str(free_port()), "--proxy", str(pport), "--gpu", "none",
                                     "--scrape-interval", "0.2", "--step", "1s"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                end = time.monotonic() + 20
                while time.monotonic() < end:
                    with socket.socket() as s:
                        if s.connect_ex(("127.0.0.1", pport)) == 0:
                            break
                    time.sleep(0.05)
                url = f"http://127.0.0.1:{pport}"
                threading.Thread(target=lambda: asyncio.run(run_load(url, short_prompts(40, max_tokens=8), concurrency=4)),
                                 daemon=True).start()
                time.sleep(rng.uniform(0.0, 1.5))
                t0 = time.monotonic()
                proc.send_signal(sig)
                _, err = proc.communicate(timeout=15)
                took = time.monotonic() - t0
            finally:
                proc.kill()
            if sig == signal.SIGTERM:
                assert proc.returncode == 0 and took < 6.0, (proc.returncode, took, err[-1500:])
            c = kvdoctor.load(cap)
            assert all("torn last line" in w for w in c.warnings), c.warnings


def test_a_report_render_that_times_out_is_ended_not_queued_behind(tmp_path, monkeypatch):
    """A render that outlives REPORT_TIMEOUT_S may be stuck for good: its worker is ended, so the
    next /report starts a new one instead of queueing behind it (each waiting the whole timeout)."""
    import concurrent.futures

    import kvdoctor.sidecar.report_page as report_page
    from kvdoctor.workers import worker_pool

    listen = free_port()
    cfg = AttachConfig(server_url="http://127.0.0.1:9", capture_dir=tmp_path / "cap", listen=f"127.0.0.1:{listen}")
    with running_agent(cfg) as agent:
        _wait_http(f"http://127.0.0.1:{listen}/healthz")
        agent.report._render_pool = worker_pool()
        agent.report._render_pool.submit(time.sleep, 120)  # the one render worker is now stuck
        worker = next(iter(agent.report._render_pool._processes))
        monkeypatch.setattr(report_page, "REPORT_TIMEOUT_S", 1.0)
        with pytest.raises(concurrent.futures.TimeoutError):
            agent.report.page()
        assert agent.report._render_pool is None
        assert_process_ends(worker, 5.0, "stuck render worker")
