"""`kvdoctor attach` against a real llama-server: numbers match the client, endpoints serve,
incidents reach a webhook and an OTLP endpoint, restarts are survived, and the capture is
crash-safe under SIGKILL and closed cleanly on SIGTERM."""
import asyncio
import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from aiohttp import web

import kvdoctor
from harness import loadgen
from harness.llama_server import LlamaServer, free_port
from harness.server_base import wait_listening
from kvdoctor.engines import effective_config

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server():
    with LlamaServer(n_ctx=2048, parallel=2) as srv:
        yield srv


class Collector:
    """A loopback HTTP endpoint that keeps what is POSTed to it (webhook, OTLP)."""

    def __init__(self):
        self.posts = []
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(10)

    def _run(self):
        async def handle(request):
            body = await request.read()
            if request.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            self.posts.append((request.path, request.headers.get("Content-Type"), body))
            return web.Response(status=200)

        async def main():
            app = web.Application()
            app.router.add_post("/{tail:.*}", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self.ready.set()
            await asyncio.Event().wait()

        self.loop.run_until_complete(main())

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


def _attach(server, tmp_path, *extra, proxy=True):
    cap = tmp_path / "cap"
    listen, pport = free_port(), free_port()
    args = [sys.executable, "-m", "kvdoctor", "attach", "--server", server.url, "--capture", str(cap),
            "--listen", f"127.0.0.1:{listen}", "--gpu", "none", "--step", "1s", *extra]
    if proxy:
        args += ["--proxy", f"127.0.0.1:{pport}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_listening(listen)
    if proxy:
        wait_listening(pport)
    return proc, cap, f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{pport}"


def _get(url, token=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.status, r.read().decode()


def test_capture_matches_client_and_endpoints_serve(server, tmp_path, wait_for):
    proc, cap, api, proxy = _attach(server, tmp_path, "--token", "s3cret")
    try:
        reqs = loadgen.short_prompts(8, max_tokens=24)
        timings = asyncio.run(loadgen.run_load(proxy, reqs, concurrency=2))
        body = wait_for(lambda: (lambda b: b if 'kvdoctor_ttft_seconds{quantile="0.99"}' in b else None)(
            _get(f"{api}/metrics", "s3cret")[1]), what="TTFT quantiles on /metrics")
        wait_for(lambda: json.loads(_get(f"{api}/healthz")[1])["records"].get("engine", 0) >= 2,
                 what="two scrapes of the server")
        assert "kvdoctor_requests_total" in body
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(f"{api}/metrics")
        assert e.value.code == 401
        assert json.loads(_get(f"{api}/healthz")[1])["status"] == "ok"  # health needs no token
        # the CLI moves garbage collections between proxied requests, and says how many ran
        gc_ = wait_for(lambda: (lambda g: g if sum(g.get("collections", {}).values()) >= 1 else None)(
            json.loads(_get(f"{api}/healthz")[1])["gc"]), what="a collection between requests")
        assert gc_["mode"] == "between_requests" and gc_["forced_while_busy"] >= 0
        assert "incidents" in json.loads(_get(f"{api}/incidents", "s3cret")[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    c = kvdoctor.load(cap)
    assert c.warnings == [], "SIGTERM must close the capture without a torn line"
    assert len(c.requests) == len(timings) == 8
    # pair each captured request with the client's by the X-Request-Id the client sent
    ids = list(c.requests.strings("request_id"))
    assert sorted(ids) == sorted(t.request_id for t in timings)
    order = [ids.index(t.request_id) for t in timings]
    assert np.max(np.abs(c.requests.num("arrival_s")[order] - [t.send_s for t in timings])) < 0.05
    d_ttft = c.requests.num("ttft_s")[order] - [t.ttft_s for t in timings]
    d_tpot = c.requests.num("tpot_s")[order] - [t.tpot_s for t in timings]
    # the proxy sees each chunk a hop earlier than the client: a few ms at most
    # (median and 90th percentile: a busy 2-core machine may hold one process for a scheduler slice)
    assert np.median(np.abs(d_ttft)) < 0.008 and np.percentile(np.abs(d_ttft), 90) < 0.030, d_ttft
    assert np.median(np.abs(d_tpot)) < 0.002, d_tpot
    assert len(c.engine.time_s) >= 2 and c.meta.engine == "llamacpp"
    assert c.meta.config.get("max_running_requests") == 2
    assert "prompt_text" not in (cap / "requests-000001.jsonl").read_text()
    # identified by the server itself: /v1/models owned_by "llamacpp", /props build_info and model
    assert c.meta.engine_version == _build(server) and c.meta.model == server.model.name
    assert c.meta.sources["identify"].ok
    [ident] = [e for e in c.events if e["kind"] == "identity"]
    assert ident["detail"]["via"] == ["/v1/models", "/props"]
    # the process's flags, read from its command line (-c 2048 --parallel 2: no batch flags given)
    eff = effective_config(c.meta.engine, c.meta.engine_version, c.meta.config)
    assert eff["max_running_requests"] == (2, "scraped") and eff["context_len_tokens"] == (1024, "scraped")
    assert eff["max_batched_tokens"][0] == 2048 and eff["max_batched_tokens"][1].startswith("default for llama.cpp")


def _build(server) -> str:
    """The build as the binary itself says it ("version: ... (build 11434, commit ...)")."""
    import re

    out = subprocess.run([str(server.binary), "--version"], capture_output=True, text=True, timeout=60)
    return "b" + re.search(r"build (\d+)", out.stdout + out.stderr)[1]


def test_sigkill_leaves_a_readable_capture(server, tmp_path, wait_for):
    proc, cap, _, proxy = _attach(server, tmp_path)
    asyncio.run(loadgen.run_load(proxy, loadgen.short_prompts(4, max_tokens=8), concurrency=2))
    wait_for(lambda: (lambda c: len(c.requests) == 4 and len(c.engine.time_s) >= 1)(kvdoctor.load(cap)),
             what="4 requests and a scrape written to the capture")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    c = kvdoctor.load(cap)  # must not raise
    assert len(c.requests) == 4
    assert len(c.engine.time_s) >= 1


def test_incident_reaches_webhook_and_otlp(server, tmp_path):
    hook, otlp = Collector(), Collector()
    proc, cap, _, proxy = _attach(server, tmp_path, "--webhook", f"{hook.url}/hook", "--otlp-endpoint", otlp.url)
    try:
        # prompts far beyond the 1,024-token slot: refused for lack of context -> kv-oom / error-burst
        reqs = loadgen.long_prompts(12, tokens=1400, max_tokens=8)
        asyncio.run(loadgen.run_load(proxy, reqs, concurrency=2))
        deadline = time.time() + 20
        while time.time() < deadline and not hook.posts:
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert hook.posts, "an incident should have been posted to the webhook"
    body = json.loads(hook.posts[0][2])
    assert body["event"] == "opened" and "text" in body and body["incident"]["causes"][0]["rule"] in ("kv-oom", "error-burst")
    assert any(p[0] == "/v1/traces" for p in otlp.posts), "incident spans should be exported over OTLP"
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    names = set()
    for path, _, raw in otlp.posts:
        if path == "/v1/traces":
            msg = ExportTraceServiceRequest()
            msg.ParseFromString(raw)
            names |= {s.name for rs in msg.resource_spans for ss in rs.scope_spans for s in ss.spans}
    assert "kvdoctor.incident.opened" in names


def test_server_restart_is_survived(tmp_path, wait_for):
    """...and the server is identified again after it: restarted under another name (--alias)
    and with another batch size, the capture ends with the new model name and flags."""
    def scrape_ok(ok):
        return lambda: json.loads(_get(f"{api}/healthz")[1])["sources"]["scrape"]["ok"] is ok

    def identities():
        return [e["detail"] for e in kvdoctor.load(cap).events if e["kind"] == "identity"]

    with LlamaServer(["-b", "512"], n_ctx=1024, parallel=1) as srv:
        proc, cap, api, _ = _attach(srv, tmp_path, proxy=False)
        try:
            wait_for(scrape_ok(True), what="the first scrape")
            wait_for(lambda: len(identities()) == 1, what="the server identified")
            srv.stop()
            wait_for(scrape_ok(False), what="the scrape to see the server gone")
            assert proc.poll() is None, "kvdoctor must not exit when the server goes away"
            srv.extra_args = ["-b", "256", "--alias", "renamed"]
            srv.start()
            wait_for(scrape_ok(True), what="scraping to resume after the restart")
            wait_for(lambda: identities()[-1]["model"] == "renamed", what="the server identified again after the restart")
            time.sleep(2.5)  # a few more scrapes after the restart
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
    c = kvdoctor.load(cap)
    kinds = [e["kind"] for e in c.events]
    assert "server-down" in kinds and "server-up" in kinds
    down = next(e["time_s"] for e in c.events if e["kind"] == "server-down")
    assert (c.engine.time_s > down).sum() >= 2, "scraping resumes after the restart"
    first, again = identities()  # one each side of the restart, both complete
    assert first["model"] == srv.model.name and again["model"] == "renamed" == c.meta.model
    assert first["engine"] == again["engine"] == c.meta.engine == "llamacpp"
    assert first["engine_version"] == again["engine_version"] == c.meta.engine_version is not None
    # the new process's -b, from its command line (llama.cpp's /props does not report it)
    eff = effective_config(c.meta.engine, c.meta.engine_version, c.meta.config)
    assert eff["max_batched_tokens"] == (256, "command line")


def test_readme_attach_block_runs_as_written(server, tmp_path, wait_for):
    """README's "Attach" block against a real llama-server, as written: the server's address,
    the two ports and the capture folder substituted (the endpoints' port is the default
    9400 there, so the test names its own with --listen), everything else as a user runs it,
    GPU sampling left at its default (no NVIDIA GPU here: it must degrade, not fail)."""
    import re
    import shlex
    import shutil
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"### Attach: live.*?```bash\n(.*?)```", readme, re.S)[1]
    lines = [ln for ln in block.splitlines() if ln and not ln.startswith("#")]
    attach, curls = lines[0], lines[1:]
    assert attach.startswith("kvdoctor attach --server http://127.0.0.1:8080") and len(curls) == 2, lines
    listen, pport = free_port(), free_port()

    def sub(text):
        return (text.replace("http://127.0.0.1:8080", server.url).replace("127.0.0.1:9000", f"127.0.0.1:{pport}")
                .replace("127.0.0.1:9400", f"127.0.0.1:{listen}").replace("cap/", str(tmp_path / "cap")))

    exe = shutil.which("kvdoctor") or str(Path(sys.executable).parent / "kvdoctor")
    args = [exe, *shlex.split(sub(attach))[1:], "--listen", f"127.0.0.1:{listen}"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_listening(pport)
        timings = asyncio.run(loadgen.run_load(f"http://127.0.0.1:{pport}", loadgen.short_prompts(6, max_tokens=16),
                                               concurrency=2))
        assert all(t.status == "ok" for t in timings)
        out = {}
        for curl in curls:
            cmd = sub(curl.split("#")[0])
            run = lambda cmd=cmd: subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=30)  # noqa: E731
            # the default live step is 5 s: the percentiles are on /metrics after the first one
            out[cmd] = wait_for(lambda: (lambda r: r.stdout if r.returncode == 0 and (
                "/incidents" in cmd or 'kvdoctor_ttft_seconds{quantile="0.99"}' in r.stdout) else None)(run()),
                timeout_s=30, what=cmd)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    metrics, incidents = out.values()
    assert "kvdoctor_requests_total" in metrics and "incidents" in json.loads(incidents)
    c = kvdoctor.load(tmp_path / "cap")
    assert sorted(c.requests.strings("request_id")) == sorted(t.request_id for t in timings)
