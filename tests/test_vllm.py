"""A real vLLM 0.32 (CPU build, SmolLM2-135M) with kvdoctor attached: every symptom the issue lists
is named by the rule it should be, the engine table covers the live /metrics page, vLLM's own OTLP
spans (gRPC and HTTP) agree with the client per request, and a client's traceparent joins the
proxy's record to vLLM's span.

Three vLLM starts (~1 min each on 2 cores), one per class: the main server (prefix caching on, gRPC
spans), prefix caching off (HTTP spans), a tiny KV cache. ``scripts/get-vllm`` installs vLLM once
per machine (see docs/test-harness.md for the cost).
"""
import asyncio
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np
import psutil
import pytest

import kvdoctor
from conftest import cause_tops, causes_fired, pages
from harness import loadgen
from harness import scenarios as S
from harness.llama_server import free_port
from harness.server_base import wait_listening
from harness.vllm_server import SERVED_NAMES, VLLM_VERSION, VllmServer
from kvdoctor.diagnosis import Options, diagnose, load_rules
from kvdoctor.engines import effective_config, parse_scrape
from kvdoctor.engines.promtext import _key, parse_families
from kvdoctor.engines.vllm import IGNORED, TABLE
from kvdoctor.objectives import parse_slo
from kvdoctor.signals.host import contended
from kvdoctor.signals.registry import fit, trend_z

pytestmark = [pytest.mark.server, pytest.mark.slow]

#: rules that may fire beside the expected one because they describe the same mechanism
RELATED = {
    # a tiny cache for 8 concurrent sequences: the plan-level rule says the same thing
    "kv-pressure-preemption": {"kv-pressure-preemption", "unsafe-concurrency", "decode-bandwidth-bound",
                               "queueing-saturation", "tail-latency"},
    "queueing-saturation": {"queueing-saturation", "tail-latency", "decode-bandwidth-bound"},
    "error-burst": {"error-burst", "unsafe-concurrency", "kv-pressure-preemption", "prompt-length-tail",
                    "queueing-saturation", "prefill-bound", "decode-bandwidth-bound", "long-prompt-hol-blocking"},
    "kv-growth-per-turn": {"kv-growth-per-turn", "prefill-bound", "decode-bandwidth-bound", "queueing-saturation"},
    "prefix-cache-ineffective": {"prefix-cache-ineffective", "prefill-bound"},
    None: set(),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Scenario name -> (capture, client timings); each scenario runs once per module."""
    return {"_dir": tmp_path_factory.mktemp("vllm")}


def run_scenario(runs, server, name, on_attach=None):
    if name not in runs:
        out = runs["_dir"] / name
        runs[name] = (out, S.run(S.SCENARIOS[name], out, engine="vllm", server=server, on_attach=on_attach))
    return runs[name]


class GaugeWatch:
    """Reads the live sidecar's own kvdoctor_* gauges every 0.2 s while a scenario runs (what a
    Prometheus scraping the sidecar would see), from a thread of its own."""

    def __init__(self, *names: str):
        self.names, self.rows, self.agent = names, [], None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __call__(self, agent) -> None:  # the on_attach hook of scenarios.run
        self.agent = agent
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            reg = self.agent.metrics.registry
            self.rows.append((time.time(), *(reg.get_sample_value(n) for n in self.names)))

    def done(self) -> np.ndarray:
        self.stop.set()
        self.thread.join(5)
        return np.array(self.rows, dtype=float).reshape(-1, 1 + len(self.names))


def check_named(out, timings, name, diag=None, tpot_slo_s=None):
    """The expected rule is a top cause, nothing unrelated fires, and the capture's TTFT is the client's.
    ``diag``: the capture's diagnosis, where the caller has it already. ``tpot_slo_s``: the stated
    TPOT P99 objective ``diag`` was judged against, which a healthy run's client must have met."""
    expect = S.SCENARIOS[name].expect
    diag = diag or diagnose(kvdoctor.load(out))
    tops = cause_tops(diag)  # causes; objective-* rules say an objective broke, not why
    fired = causes_fired(diag)
    report = json.dumps(diag.to_json()["incidents"], indent=1)[:3000]
    if expect is None:
        from harm_checks import skip_unless_client_met_objectives

        skip_unless_client_met_objectives(timings, tpot_slo_s or 0.1)
        assert not pages(diag), f"{name} should raise no incident:\n{report}"
    else:
        assert expect in tops, f"{name}: expected {expect} as a top cause, got {tops}:\n{report}"
        assert fired <= RELATED[expect], f"{name}: unrelated rules fired {fired - RELATED[expect]}:\n{report}"
    cap = kvdoctor.load(out)
    by_id = dict(zip(cap.requests.strings("request_id"), cap.requests.num("ttft_s")))
    ok = [t for t in timings if t.status == "ok" and t.ttft_s is not None]
    assert ok and all(t.request_id in by_id for t in ok), "every successful client request is in the capture"
    proxy, client = np.array([by_id[t.request_id] for t in ok]), np.array([t.ttft_s for t in ok])
    # the proxy sees each first chunk before the client does (the client shares a busy process with
    # the agent: with 8 streams it reads tens of ms late), and its TTFT is most of the client's
    assert np.all(proxy <= client + 0.002), client - proxy
    assert np.median((client - proxy) / client) < 0.25, (client, proxy)
    return diag


def client_turn_growth(timings, what: str, leave_out=frozenset()) -> tuple[float, float]:
    """The client's own per-turn growth, read as kv-growth-per-turn reads the capture: the fitted
    change per turn of the per-turn median (``decode``: each request's median gap between text
    chunks; ``ttft``), as a share of turn 1's, and the stratified trend z within each conversation.
    ``leave_out``: request ids the diagnosis left out of this trend (run on a contended host; for
    decode, also streams read in bursts)."""
    rows = [(t.session_id, t.turn, float(np.median(np.diff(t.chunk_times_s))) if what == "decode" else t.ttft_s)
            for t in timings if t.status == "ok" and t.ttft_s is not None and len(t.chunk_times_s) >= 3
            and t.request_id not in leave_out]
    by_turn: dict[int, list[float]] = {}
    for _, turn, v in rows:
        by_turn.setdefault(turn, []).append(v)
    turns = sorted(by_turn)
    if len(turns) < 4:  # the diagnosis left out most requests (a contended host): no trend to read
        return float("nan"), float("nan")
    med = np.array([np.median(by_turn[k]) for k in turns])
    slope, _, _ = fit(np.array(turns, dtype=float), med, min_n=4)
    session = np.unique([r[0] for r in rows], return_inverse=True)[1]
    z = trend_z(session.ravel(), np.array([r[1] for r in rows], dtype=float), np.array([r[2] for r in rows]))
    return slope / med[0], z


def expect_turn_growth(diag, timings) -> None:
    """Whether vLLM's turns really got slower is the server's physics on this machine, not the
    load's: a 135M model's decode step is mostly its weights, so the history's KV grows it by a few
    per cent a turn on a quiet machine (2.6-8%/turn) and not at all when the step is dominated by
    other costs (a fresh-clone run saw ITL ~120 ms flat over 8 turns). The client's timings, on the
    requests the diagnosis kept (not those run on a contended host or read in bursts), are the ground
    truth, read with the rule's own statistics. Clear growth (half again the rule's size threshold,
    and a trend z 1.5 past its own: the proxy's gaps are not the client's to the last per cent), or
    the rule fired: it must be the top cause (check_named, after this). No growth: the rule must
    stay silent, and the positive case is reported as not exercised. Near a threshold and silent:
    either verdict was right."""
    params = next(r for r in load_rules() if r.id == "kv-growth-per-turn").params
    whole = diag.prepared.window(diag.start_s, diag.end_s)
    ids, held = whole.prep.request_ids[whole.req], contended(whole)
    unread = whole.prep.read_late[whole.req]  # streams read in bursts: no decode gaps measured
    (dec, dec_z), (ttft, ttft_z) = (client_turn_growth(timings, "decode", frozenset(ids[held | unread])),
                                    client_turn_growth(timings, "ttft", frozenset(ids[held])))
    seen = (f"client: decode {dec:+.1%}/turn (trend z {dec_z:.1f}), TTFT {ttft:+.1%}/turn (z {ttft_z:.1f}); "
            f"left out: {int(held.sum())} requests run on a contended host, {int(unread.sum())} streams read in bursts")
    fired = "kv-growth-per-turn" in {c.rule.id for inc in diag.incidents for c in inc.causes}
    if not fired and not (np.isfinite(dec) or np.isfinite(ttft)):
        pytest.skip(f"too few turns left to read the client's trend ({seen}): the host was busy")
    z_min = params["min_trend_z"]
    flat = ((dec < 0.5 * params["min_tpot_growth"] or dec_z < 0.5 * z_min)
            and (ttft < 0.5 * params["min_ttft_growth"] or ttft_z < 0.5 * z_min))
    if flat:
        assert not fired, f"no turn got slower, yet kv-growth-per-turn fired ({seen})"
        pytest.skip(f"vLLM's turns did not slow down on this machine ({seen}): "
                    "checked that kv-growth-per-turn stays silent")
    clear = ((dec >= 1.5 * params["min_tpot_growth"] and dec_z >= z_min + 1.5)
             or (ttft >= 1.5 * params["min_ttft_growth"] and ttft_z >= z_min + 1.5))
    assert fired or not clear, f"the client saw every turn clearly slower ({seen}), yet kv-growth-per-turn stayed silent"
    if not fired:
        pytest.skip(f"vLLM's turns slowed down near kv-growth-per-turn's thresholds ({seen}) "
                    "and it stayed silent: either verdict is right")
    print(f"kv-growth-per-turn fired; {seen}")


def cause(diag, rule_id) -> dict:
    return next(c for inc in diag.to_json()["incidents"] for c in inc["causes"] if c["rule"] == rule_id)


def evidence(c) -> dict:
    return {k: v["value"] for k, v in c["evidence"].items()}


def metric(server, *names, **labels) -> float:
    """The sum of every sample of ``names`` with ``labels``, from one read of ``/metrics``."""
    _, body = server.get("/metrics")
    total = 0.0
    for fam in parse_families(body):
        for s in fam.samples:
            if s.name in names and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


# ------------------------------------------------------------------ spans: no proxy, then a traceparent

def direct_load(url, n, seed):
    """Requests straight to vLLM, as a client without kvdoctor in the path would send them."""
    reqs = S._fixed(loadgen.short_prompts(n, max_tokens=12 + 4 * (seed % 3), seed=seed))
    for i, r in enumerate(reqs):
        r.max_tokens = 8 + 6 * (i % 4)  # different decode lengths, so pairing by id matters
    return asyncio.run(loadgen.run_load(url, reqs, concurrency=2, timeout_s=120))


def wait_for_records(att, want_ids, timeout_s=60.0):
    """vLLM batches spans (OTEL_BSP_SCHEDULE_DELAY): wait until the agent has them all."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        have = {r.request_id for r in att.agent.live_worker.recent("requests")}
        if want_ids <= have:
            return
        time.sleep(0.5)
    pytest.fail(f"spans missing after {timeout_s:.0f}s: {sorted(want_ids - have)[:5]}")


def check_spans_match_client(cap, timings):
    """vLLM's span of each request (id chatcmpl-<X-Request-Id>) against the client's own timings."""
    recs = {rid: i for i, rid in enumerate(cap.requests.strings("request_id"))}
    num = {k: cap.requests.num(k) for k in ("arrival_s", "ttft_s", "e2e_s", "queue_s", "tpot_s", "prefill_s",
                                            "decode_s", "prompt_tokens", "output_tokens")}
    eps = 0.005  # one clock, two processes: timestamps are taken a few instructions apart
    for t in timings:
        assert t.status == "ok", t.error
        i = recs[f"chatcmpl-{t.request_id}"]
        arrival, ttft, e2e, queue = (num[k][i] for k in ("arrival_s", "ttft_s", "e2e_s", "queue_s"))
        # vLLM's clock starts after the client sent and stops before the client read the last chunk
        assert t.send_s - eps <= arrival and arrival + e2e <= t.finish_s + eps, (t, arrival, e2e)
        assert 0 < ttft <= t.ttft_s + eps and ttft <= e2e and 0 <= queue <= ttft
        # vLLM's first token happens before the client reads it. Decode is timed in vLLM's engine
        # core, e2e and TTFT in its API server (clocks read tens of ms apart on a busy machine), and
        # chunks may reach the client bunched, so decode is only bounded by the whole request
        prefill, decode = num["prefill_s"][i], num["decode_s"][i]
        assert decode == pytest.approx(num["tpot_s"][i] * (num["output_tokens"][i] - 1))
        assert 0 < decode < e2e
        # the engine's queue and prefill (queued -> scheduled -> first token) lie within the API
        # server's TTFT and so within the client's; the whole engine split within the client's E2E
        assert 0 < prefill and queue + prefill <= ttft + eps <= t.ttft_s + 2 * eps, (queue, prefill, ttft, t.ttft_s)
        assert queue + prefill + decode <= t.finish_s - t.send_s + eps
        assert arrival + ttft <= t.first_token_s + eps, (arrival + ttft, t.first_token_s)
        assert (num["prompt_tokens"][i], num["output_tokens"][i]) == (t.prompt_tokens, t.output_tokens)
    # and the server's TTFT moves with the client's across requests (pairing, not two distributions)
    server_ttft = np.array([num["ttft_s"][recs[f"chatcmpl-{t.request_id}"]] for t in timings])
    client_ttft = np.array([t.ttft_s for t in timings])
    assert np.all(client_ttft - server_ttft >= -eps)


# ------------------------------------------------------------------ main server

@pytest.fixture(scope="class")  # one server per class, stopped when the class is done
def main():
    port = free_port()
    with VllmServer(**S.VLLM_MAIN, otlp_endpoint=f"http://127.0.0.1:{port}", otlp_protocol="grpc") as srv:
        srv.otlp_port = port
        yield srv


class TestMainServer:
    """Prefix caching on, at most 4 sequences, spans over gRPC (vLLM's default protocol)."""

    def test_spans_over_grpc_and_traceparent_join(self, main, tmp_path):
        out = tmp_path / "cap"
        with S.AttachedAgent(main.url, out, main.pid, otlp_grpc_receiver=f"127.0.0.1:{main.otlp_port}") as att:
            # no proxy in the path: only vLLM's spans tell kvdoctor about these
            direct = direct_load(main.url, 8, seed=1)
            # through the proxy, with a W3C traceparent: the proxy's record and vLLM's span share it
            traced = S._fixed(loadgen.short_prompts(3, max_tokens=8, seed=4))
            trace_ids = {}
            for r in traced:
                trace_ids[r.request_id] = uuid.uuid4().hex
                r.headers["traceparent"] = f"00-{trace_ids[r.request_id]}-{uuid.uuid4().hex[:16]}-01"
            proxied = asyncio.run(loadgen.run_load(att.proxy_url, traced, concurrency=1, timeout_s=120))
            assert all(t.status == "ok" for t in proxied), [t.error for t in proxied]
            wait_for_records(att, {f"chatcmpl-{t.request_id}" for t in direct + proxied})
        cap = kvdoctor.load(out)
        check_spans_match_client(cap, direct)

        ids, traces = cap.requests.strings("request_id"), cap.requests.strings("trace_id")
        for t in proxied:
            mine = trace_ids[t.request_id]
            rows = sorted(rid for rid, tr in zip(ids, traces) if tr == mine)
            # exactly two records carry the client's trace id: the proxy's and vLLM's span
            assert rows == sorted([t.request_id, f"chatcmpl-{t.request_id}"]), rows
        assert not any(tr for rid, tr in zip(ids, traces) if rid.removeprefix("chatcmpl-") in
                       {t.request_id for t in direct} and tr in trace_ids.values())

    def test_readme_attach_example(self, main, tmp_path):
        """The README's `kvdoctor attach` beside vLLM, run as written (ports and folder substituted)."""
        readme = (Path(__file__).parents[1] / "README.md").read_text()
        line = next(x for x in readme.splitlines() if x.startswith("kvdoctor attach --server http://127.0.0.1:8000"))
        proxy_port = free_port()
        cmd = (line.replace("127.0.0.1:8000", f"127.0.0.1:{main.port}").replace("127.0.0.1:9000", f"127.0.0.1:{proxy_port}")
               .replace("127.0.0.1:4317", f"127.0.0.1:{main.otlp_port}").replace("cap/", str(tmp_path / "cap")))
        assert cmd != line and "--otlp-grpc-receiver" in cmd
        exe = shutil.which("kvdoctor") or str(Path(sys.executable).parent / "kvdoctor")
        args = [exe, *shlex.split(cmd)[1:], "--listen", f"127.0.0.1:{free_port()}", "--gpu", "none", "-q"]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_listening(proxy_port, timeout_s=60)
            proxied = asyncio.run(loadgen.run_load(f"http://127.0.0.1:{proxy_port}",
                                                   S._fixed(loadgen.short_prompts(3, max_tokens=8, seed=6)),
                                                   concurrency=1, timeout_s=120))
            time.sleep(2.5)  # vLLM's span batch (0.5 s) and one more scrape
        finally:
            proc.send_signal(signal.SIGTERM)
            output = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, output
        cap = kvdoctor.load(tmp_path / "cap")
        ids = set(cap.requests.strings("request_id"))
        for t in proxied:
            assert t.status == "ok" and t.request_id in ids and f"chatcmpl-{t.request_id}" in ids, (t, output)
        assert cap.meta.config.get("kv_capacity_tokens") == main.kv_capacity_tokens_logged()
        assert cap.meta.config.get("context_len_tokens") == S.VLLM_MAIN["max_model_len"]  # from /v1/models
        # identified by vLLM itself: /v1/models (owned_by "vllm", the first served name), /version
        assert (cap.meta.engine, cap.meta.engine_version, cap.meta.model) == ("vllm", VLLM_VERSION, SERVED_NAMES[0])
        assert cap.meta.sources["identify"].ok
        [ident] = [e["detail"] for e in cap.events if e["kind"] == "identity"]
        assert ident["via"] == ["/v1/models", "/version"], ident
        # the effective configuration: cache_config_info says prefix caching (scraped); vLLM reports
        # no --max-num-seqs, attach read it from the server's command line
        eff = effective_config(cap.meta.engine, cap.meta.engine_version, cap.meta.config)
        assert eff["prefix_caching"] == (True, "scraped") and eff["kv_cache_dtype"] == ("auto", "scraped")
        assert eff["context_len_tokens"] == (S.VLLM_MAIN["max_model_len"], "scraped")
        assert eff["max_running_requests"] == (S.VLLM_MAIN["max_num_seqs"], "command line"), (eff, output)
        assert eff["chunked_prefill"][1].startswith("default for vLLM >= 0.8.0")

    def test_metrics_page_maps_completely(self, main):
        status, body = main.get("/metrics")
        assert status == 200
        # *_created: prometheus_client's creation-time gauge beside each counter/histogram, not a metric
        names = {_key(f.name) for f in parse_families(body) if f.name.startswith("vllm:")
                 and not f.name.endswith("_created")}
        known = {_key(w.wire) for w in TABLE.metrics} | {_key(i.wire) for i in TABLE.info} | {_key(n) for n in IGNORED}
        assert not names - known, f"vLLM {sorted(names - known)} neither mapped nor in IGNORED"
        # the names 0.32 dropped (kvdoctor still reads them from older servers)
        for gone in ("vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits",
                     "vllm:time_per_output_token_seconds", "vllm:num_requests_swapped"):
            assert gone not in names
        assert not {_key(n) for n in IGNORED} - names, "IGNORED lists a name 0.32 does not have"
        sample, config, engine = parse_scrape(body, time.time())
        assert engine == "vllm" and config["model"] in ("smollm2", "default")
        assert config["prefix_caching"] is True and config["kv_block_size_tokens"] > 0
        for n in ("requests_running", "requests_waiting", "requests_waiting_capacity", "kv_usage_frac",
                  "preemptions_total", "prefix_cache_queries_total", "requests_rejected_total", "read_bytes_total"):
            assert n in sample.values, n

    def test_kv_capacity_is_what_vllm_logged(self, main, run_cli):
        logged = main.kv_capacity_tokens_logged()
        assert logged, main.log_tail()
        _, config, _ = parse_scrape(main.get("/metrics")[1], time.time())
        assert config["kv_capacity_tokens"] == logged
        # kvdoctor's own arithmetic from the model's config.json, the KV bytes vLLM was given and
        # the dtype it computes in (KV "auto" is the model's dtype: float32 on an AVX2-only CPU)
        r = run_cli("plan", "--model", main.model, "--max-len", S.VLLM_MAIN["max_model_len"],
                    "--kv-mem", config["kv_cache_bytes"], "--block-size", config["kv_block_size_tokens"],
                    "--kv-dtype", {"float32": "fp32", "bfloat16": "bf16"}[main.dtype], "--format", "json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["max_kv_tokens"] == logged

    def test_healthy_mixed_prompts_pages_nobody(self, main, runs):
        """Issue 31: two light users with mixed prompt sizes on real vLLM page nobody; a stated
        objective the same capture breaks pages."""
        from harm_checks import check_healthy_mixed

        out, timings = run_scenario(runs, main, "healthy-mixed")
        # against a CPU deployment's stated TPOT objective: float32 vLLM on an AVX2-only EPYC
        # decodes two light users at TPOT P99 ~150 ms, over the chat default for real
        check_healthy_mixed(out, timings, tpot_slo_s=0.25 if main.dtype == "float32" else None)

    def test_ramp_onset_is_where_the_queue_formed(self, main, runs):
        """Issue 31: one user, then twelve on vLLM's four sequences: the incident starts where the
        queue formed, offline and in the live sidecar."""
        from harm_checks import check_ramp

        agents = []
        out, timings = run_scenario(runs, main, "ramp", on_attach=agents.append)
        check_ramp(out, timings, agents[0], len(S.SCENARIOS["ramp"].phases[0].requests()), hold_s=30.0)

    @pytest.mark.parametrize("name", ["prefix-cache-on", "saturation", "multi-turn"])
    def test_scenario(self, main, runs, run_cli, name):
        out, timings = run_scenario(runs, main, name)
        # a healthy run against a CPU deployment's stated TPOT objective where vLLM runs in float32
        # (one stream decodes at 65-90 ms a token there: the chat default's 100 ms is at its edge)
        tpot_slo_s = 0.25 if name == "prefix-cache-on" and main.dtype == "float32" else None
        stated = Options(slo=parse_slo([f"tpot_p99={tpot_slo_s * 1000:.0f}ms"])) if tpot_slo_s else None
        diag = diagnose(kvdoctor.load(out), options=stated)
        if name == "multi-turn":
            expect_turn_growth(diag, timings)
        diag = check_named(out, timings, name, diag, tpot_slo_s)
        if name == "saturation":
            ev = evidence(cause(diag, "queueing-saturation"))
            # the queue time is vLLM's own histogram (the proxy cannot see queueing inside vLLM)
            assert ev["queue_p50_s"] > 0 and ev["requests_waiting_p50"] >= 1, ev
            # plan sizes from the capture's cache_config_info (KV bytes, block size) alone
            r = run_cli("plan", "--model", main.model, "--max-len", S.VLLM_MAIN["max_model_len"],
                        "--from-capture", out, "--format", "json")
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)["max_kv_tokens"] == main.kv_capacity_tokens_logged()
        if name == "multi-turn":
            c = cause(diag, "kv-growth-per-turn")
            ev = evidence(c)
            # vLLM's prefix cache serves the history: the fix "turn prefix caching on" is not offered
            assert ev["prefix_hit_rate_achieved"] >= 0.5, ev
            assert "prefix caching" not in " ".join(f["title"] for f in c["fixes"]).lower()
        if name == "prefix-cache-on":
            # vLLM's own counters: all but the first request found the shared prefix in the cache
            eng = kvdoctor.load(out).engine
            hits, queries = (np.ptp(eng.get(n)) for n in ("prefix_cache_hits_total", "prefix_cache_queries_total"))
            assert queries > 0 and hits / queries >= 0.5 * (len(timings) - 1) / len(timings), (hits, queries)

    def test_quality_probe_reads_vllm_token_ids(self, main):
        """`kvdoctor quality`'s teacher-forced probe on vLLM: the chat prompt tokenised by vLLM's own
        /tokenize is what its chat endpoint counts, the continuation comes back as token ids, and a
        server forced against itself agrees at every position (the method's floor)."""
        from kvdoctor.quality.probe import _dialect, complete, forced_agreement, prompt_ids

        msgs = S.quality_prompts(1, 300, 300)[0]
        assert _dialect(main.url, 10.0) == ("openai", SERVED_NAMES[0])
        ids = prompt_ids(main.url, msgs, 30.0, _dialect(main.url, 10.0))
        assert ids and len(ids) == complete(main.url, msgs, 1, 60.0)[1]  # usage.prompt_tokens of the chat request
        f, n = forced_agreement(main.url, main.url, msgs, 8, 60.0)
        assert 0 < n <= 8 and f == 1.0

    def test_client_disconnect_is_not_an_abort(self, main, tmp_path):
        """A client that leaves mid-stream: the proxy cuts its upstream connection at once, so vLLM
        stops generating (and does not count the request as finished or aborted); the capture
        records it as cancelled."""
        wait_idle(main)  # nothing from an earlier test still running: the counters below are this request's
        out = tmp_path / "cap"
        finished = lambda: metric(main, "vllm:request_success_total")  # noqa: E731 - every finished_reason
        aborts0, finished0 = metric(main, "vllm:request_success_total", finished_reason="abort"), finished()
        gen0 = metric(main, "vllm:generation_tokens_total")
        with S.AttachedAgent(main.url, out, main.pid) as att:
            async def leave_early():
                body = {"model": "default", "stream": True, "max_tokens": 400, "ignore_eos": True,
                        "messages": [{"role": "user", "content": "Count to a thousand."}]}
                async with aiohttp.ClientSession() as s:
                    async with s.post(att.proxy_url + "/v1/chat/completions", json=body,
                                      headers={"X-Request-Id": "leaves-early"}) as resp:
                        n = 0
                        async for line in resp.content:
                            n += line.startswith(b"data:")
                            if n >= 3:
                                return upstream_conns(main.port)  # the client goes away mid-stream
            streaming = asyncio.run(leave_early())
            t_left = time.monotonic()
            assert streaming, "no connection from the proxy to vLLM while the stream was relayed"
            # the proxy's upstream connection closes (scrapes use short-lived ones of their own)
            while upstream_conns(main.port) & streaming and time.monotonic() - t_left < 5:
                time.sleep(0.02)
            cut_s = time.monotonic() - t_left
            assert not upstream_conns(main.port) & streaming, "the proxy kept its upstream connection 5 s after the client left"
            wait_idle(main)
            idle_s = time.monotonic() - t_left
            time.sleep(1.5)  # one more scrape
        generated, ran_out = metric(main, "vllm:generation_tokens_total") - gen0, finished() - finished0
        cap = kvdoctor.load(out)
        rec = {k: dict(zip(cap.requests.strings("request_id"), cap.requests.strings(k))).get("leaves-early")
               for k in ("status", "error")}
        facts = (f"proxy cut its upstream connection {cut_s * 1000:.0f} ms after the client left; vLLM idle "
                 f"after {idle_s:.1f} s, {generated:.0f} tokens generated, {ran_out:.0f} requests finished; record {rec}")
        assert generated < 400 and ran_out == 0, "vLLM ran the request on after the proxy left: " + facts
        assert metric(main, "vllm:request_success_total", finished_reason="abort") == aborts0, facts
        assert rec["status"] == "cancelled", facts


def upstream_conns(port: int) -> set:
    """This process's established TCP connections to ``port`` (local ends)."""
    return {c.laddr for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED}


def wait_idle(server, timeout_s: float = 60) -> None:
    """Until vLLM has no request running or waiting."""
    deadline = time.monotonic() + timeout_s
    while metric(server, "vllm:num_requests_running", "vllm:num_requests_waiting") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)


# ------------------------------------------------------------------ prefix caching off

HARNESS_DOC = Path(__file__).parents[1] / "docs" / "test-harness.md"


def doc_vllm_block() -> tuple[dict, str, list]:
    """docs/test-harness.md's VllmServer block: (its imports run, the `with` statement's
    VllmServer(...) call as written, the statements of the with's body)."""
    import ast

    block = re.search(r"runs as written in tests/test_vllm\.py[^)]*\) -->\n```python\n(.*?)```",
                      HARNESS_DOC.read_text(), re.S)
    assert block, "docs/test-harness.md: no python block marked to run as written in tests/test_vllm.py"
    tree = ast.parse(block[1])
    with_ = [n for n in tree.body if isinstance(n, ast.With)]
    assert len(with_) == 1, "docs/test-harness.md's VllmServer block: expected one `with VllmServer(...) as srv:`"
    ns: dict = {}
    exec(compile(ast.Module([n for n in tree.body if n is not with_[0]], []), str(HARNESS_DOC), "exec"), ns)
    return ns, ast.get_source_segment(block[1], with_[0].items[0].context_expr), with_[0].body


@pytest.fixture(scope="class")  # one server per class, stopped when the class is done
def off():
    """The prefix-caching-off server is docs/test-harness.md's example, started as written (the
    OTLP receiver's port substituted); its options must be the prefix-cache-off scenario's."""
    import ast

    port = free_port()
    opts = S.vllm_options(S.SCENARIOS["prefix-cache-off"])
    assert opts == {**S.VLLM_MAIN, "prefix_caching": False}
    ns, call, _ = doc_vllm_block()
    written = {k.arg: ast.literal_eval(k.value) for k in ast.parse(call, mode="eval").body.keywords}
    assert {k: v for k, v in written.items() if not k.startswith("otlp_")} == opts, \
        f"docs/test-harness.md: {call} is no longer the prefix-cache-off scenario's server ({opts})"
    mine = call.replace("http://127.0.0.1:4318/", f"http://127.0.0.1:{port}/")
    assert mine != call, call
    with eval(mine, ns) as srv:
        srv.otlp_port = port
        yield srv


class TestPrefixCachingOff:
    """The same server without prefix caching; spans over OTLP/HTTP."""

    def test_prefix_cache_off(self, off, runs):
        out, timings = run_scenario(runs, off, "prefix-cache-off")
        diag = check_named(out, timings, "prefix-cache-off")
        c = cause(diag, "prefix-cache-ineffective")
        assert evidence(c)["prefix_hit_rate_achieved"] < 0.1
        assert "--enable-prefix-caching" in json.dumps(c["fixes"])
        assert kvdoctor.load(out).meta.config.get("prefix_caching") is False  # from cache_config_info

    def test_doc_block_body_runs(self, off):
        """The body of docs/test-harness.md's `with VllmServer(...) as srv:` block, on the server
        that block started (the `off` fixture)."""
        import ast

        ns, _, body = doc_vllm_block()
        exec(compile(ast.Module(body, []), str(HARNESS_DOC), "exec"), {**ns, "srv": off})
        assert (off.kv_capacity_tokens_logged() or 0) > 0

    def test_spans_over_http(self, off, tmp_path):
        out = tmp_path / "cap"
        with S.AttachedAgent(off.url, out, off.pid, otlp_receiver=f"127.0.0.1:{off.otlp_port}") as att:
            direct = direct_load(off.url, 6, seed=2)
            wait_for_records(att, {f"chatcmpl-{t.request_id}" for t in direct})
        check_spans_match_client(kvdoctor.load(out), direct)


def test_compare_off_then_on_says_fixed(runs, run_cli):
    for name in ("prefix-cache-off", "prefix-cache-on"):
        if name not in runs:
            pytest.skip(f"needs the {name} run of this module")
    r = run_cli("compare", runs["prefix-cache-off"][0], runs["prefix-cache-on"][0], "--format", "json")
    assert r.returncode == 0, r.stderr
    c = json.loads(r.stdout)
    rule = next(x for x in c["rules"] if x["rule"] == "prefix-cache-ineffective")
    assert rule["status"] == "resolved" and rule["impact"]["verdict"] == "better", c["headline"]
    verdict = {s["name"]: s["verdict"] for s in c["signals"]}
    assert verdict["ttft_p50_s"] == "better", c["headline"]
    # prefix caching changes prefill only; the two runs use different servers minutes apart on a
    # shared 2-core VM, so decode speed drifts between them. Tested one by one at 95% a drift of a
    # few percent read "worse" (ITL P50 +5.0% [CI +0.2%, +8.2%] on the recorded samples); Holm's
    # correction over the ~15 signals absorbs that. A larger drift is measured, not noise (one run
    # here: ITL P50 +23% [CI +12%, +31%] at the same concurrency, 1.0 in flight on both sides), and
    # compare rightly reports it: a trade-off is accepted only in the decode step's own signals,
    # never on the prefill side the fix acts on, nor in errors or throughput
    worse = {s["name"] for s in c["signals"] if s["verdict"] == "worse"}
    decode_step = {f"{m}_p{q}_s" for m in ("tpot", "itl") for q in (50, 90, 99)}
    assert c["verdict"] == "fixed" or (c["verdict"] == "trade-off" and worse and worse <= decode_step), c["headline"]
    assert c["headline"].startswith(("Fixed: prefix-cache-ineffective resolved",
                                     "Trade-off: prefix-cache-ineffective resolved")), c["headline"]
    assert c["method"]["family_correction"] == "holm"


# ------------------------------------------------------------------ a tiny KV cache

@pytest.fixture(scope="class")  # one server per class, stopped when the class is done
def tiny():
    assert S.vllm_options(S.SCENARIOS["preemption"]) == S.vllm_options(S.SCENARIOS["context-overflow"])
    with VllmServer(**S.vllm_options(S.SCENARIOS["preemption"])) as srv:
        yield srv


class TestTinyKvCache:
    """9 KV blocks of 128 tokens, sequences of at most 512 tokens, 8 at a time."""

    def test_preemption(self, tiny, runs):
        watch = GaugeWatch("kvdoctor_kv_full_forecast_seconds", "kvdoctor_kv_usage_ratio")
        out, timings = run_scenario(runs, tiny, "preemption", on_attach=watch)
        seen = watch.done()
        diag = check_named(out, timings, "preemption")
        ev = evidence(cause(diag, "kv-pressure-preemption"))
        assert ev["preemptions_per_min"] > 0 and ev["kv_usage_max_frac"] >= 0.9, ev
        # the gauge that moves at once (the counter waits for a preempted request to resume)
        cap = kvdoctor.load(out)
        waiting = cap.engine.get("requests_waiting_capacity")
        assert waiting is not None and np.nanmax(waiting) >= 1
        # the live "KV full in N min" forecast, as the sidecar exported it during the run: "full
        # now" (0 s) while requests waited for blocks, though block-granular usage stayed below
        # 100% most of that time (usage alone saw no growth to forecast)
        t_w, forecast_s, usage = seen.T
        # a reading every 0.2 s in principle; the watching thread shares a process (and its GIL)
        # with the proxy, the agent and the client on two cores busy with vLLM: a fresh CI run got
        # 24 in 70 s. Enough to see the forecast's first, "full" and later readings
        assert len(seen) >= 10, seen
        full = forecast_s == 0
        assert full.any(), f"the forecast never said full: {np.unique(forecast_s[np.isfinite(forecast_s)])}"
        # nothing is known before the first live step (a gauge's default 0 would read "full now")
        assert np.isnan(forecast_s[0]), seen[:3]
        # each "full" reading came while the engine held requests back, or was at 100%, by its own
        # gauges: a reading is the last live step's (every 5 s, each a few seconds on 2 busy cores),
        # from the scrapes before it (every 1 s). Counted in scrapes, not seconds: a starved
        # scraper (CI once went over 10 s without one) or the gauge holding its last value after
        # the run leaves no scrape in a fixed span, while the step still saw the last ones
        t_e, usage_e = cap.engine.time_s, cap.engine.get("kv_usage_frac")
        for ts in t_w[full]:
            recent = np.flatnonzero(t_e <= ts)[-10:]
            assert len(recent), f"a 'full' reading at {ts} before the first scrape at {t_e[0]}"
            assert np.nanmax(waiting[recent]) >= 1 or np.nanmax(usage_e[recent]) >= 1, (ts, t_e[recent])
        # and at least once while the usage gauge read below 100% (the case usage alone missed)
        assert np.nanmin(usage[full]) < 1, np.unique(usage[full])
        _, config, _ = parse_scrape(tiny.get("/metrics")[1], time.time())
        assert config["kv_capacity_tokens"] == tiny.kv_capacity_tokens_logged() == 9 * config["kv_block_size_tokens"]

    def test_context_overflow(self, tiny, runs):
        out, timings = run_scenario(runs, tiny, "context-overflow")
        diag = check_named(out, timings, "context-overflow")
        refused = [t for t in timings if t.status != "ok"]
        assert refused and all(t.http_status == 400 for t in refused), {t.error for t in refused}
        # a context refusal is the request's length, not KV memory (issue 31): error-burst counts
        # them, and kv-oom (memory only) does not claim them
        ev = evidence(cause(diag, "error-burst"))
        assert ev["context_errors"] == len(refused), ev
        assert "kv-oom" not in causes_fired(diag)


def test_harness_doc_get_vllm_block_runs_as_written():
    """docs/test-harness.md's vLLM block: `scripts/get-vllm` as written (installed already: it only
    prints the interpreter and model paths), then its pytest line, collected only."""
    from conftest import doc_blocks_for, run_get_then_collect_block

    (block,) = [b for b in doc_blocks_for("docs/test-harness.md", "tests/test_vllm.py") if "scripts/get-vllm" in b]
    out = run_get_then_collect_block(block, "docs/test-harness.md (get-vllm)")
    assert "vllm python: " in out and "model: " in out
