"""Fleet mode (kvdoctor/prometheus, kvdoctor/fleet): query building, mapping, fleet findings; and end to end against a
real Prometheus scraping two real llama-servers, one overloaded on purpose."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvdoctor.diagnosis import Options, load_rules
from kvdoctor.errors import InputError
from kvdoctor.fleet import diagnose_fleet
from kvdoctor.prometheus import FleetData, PromClient, PromError, capture_for, fetch, from_capture
from kvdoctor.prometheus.query import Selectors, discovery_selectors, plan, selector_matchers, time_range
from kvdoctor.model import EngineSample


# -- no servers ---------------------------------------------------------------------------------

def test_selector_and_range_parsing():
    assert selector_matchers('{job="vllm", ns=~"prod.*"}') == 'job="vllm",ns=~"prod.*"'
    assert selector_matchers(None) == ""
    with pytest.raises(InputError):
        selector_matchers("{job=vllm}")
    assert time_range("3m", None, None, now=1000.0) == (820.0, 1000.0)
    assert time_range(None, "10", "20") == (10.0, 20.0)
    with pytest.raises(InputError):
        time_range(None, "20", "10")
    one = discovery_selectors('job="x"')
    assert len(one) == 1 and 'job="x"' in one[0] and "vllm:.*" in one[0] and "DCGM_FI_.*" in one[0]
    eng, gpu, side = discovery_selectors(Selectors.parse('{job="v"}', '{job="dcgm"}', None))
    assert "vllm:.*" in eng and "DCGM" not in eng and 'job="v"' in eng
    assert gpu == '{__name__=~"DCGM_FI_.*",job="dcgm"}' and side == '{__name__=~"kvdoctor_.*",job="v"}'


def test_plan_one_query_per_wire_name_histograms_by_bucket():
    names = ["vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
             "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
             "vllm_num_requests_running", "DCGM_FI_DEV_FB_USED", "kvdoctor_incident_active", "vllm:unknown"]
    p = {x.name: x for x in plan(names, 'job="v"')}
    assert set(p) == {"vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
                      "vllm_num_requests_running", "DCGM_FI_DEV_FB_USED", "kvdoctor_incident_active"}
    assert p["vllm:time_to_first_token_seconds_bucket"].histogram
    assert p["vllm:num_requests_waiting"].query == '{__name__="vllm:num_requests_waiting",job="v"}'
    assert p["DCGM_FI_DEV_FB_USED"].table.name == "dcgm"


def _fleet(waiting: dict[str, float], load: dict[str, float], n: int = 40) -> FleetData:
    d = FleetData(0.0, (n - 1) * 10.0, 10.0, "test")
    for name, w in waiting.items():
        d.samples[name] = [EngineSample(time_s=i * 10.0, engine="vllm", server=name,
                                        values={"requests_waiting": w, "requests_running": 4.0,
                                                "generation_tokens_total": load[name] * i * 10.0})
                           for i in range(n)]
        d.engines[name] = "vllm"
    return d


def test_fleet_findings_replica_vs_fleet():
    rules, opts = load_rules(), Options(lookback_s=120, step_s=10)
    one = diagnose_fleet(_fleet({"a:1": 6, "b:1": 0, "c:1": 0}, {"a:1": 300, "b:1": 100, "c:1": 100}), rules, opts)
    q = [f for f in one.findings if f["rule"] == "queueing-saturation"]
    assert q and q[0]["instances"] == ["a:1"] and q[0]["scope"] == "replica" and q[0]["kind"] == "imbalance"
    assert not one.per_instance["b:1"].incidents
    sick = diagnose_fleet(_fleet({"a:1": 6, "b:1": 0, "c:1": 0}, {"a:1": 100, "b:1": 100, "c:1": 100}), rules, opts)
    assert [f["kind"] for f in sick.findings if f["rule"] == "queueing-saturation"] == ["sick-host"]
    allr = diagnose_fleet(_fleet({"a:1": 6, "b:1": 5, "c:1": 7}, {"a:1": 100, "b:1": 100, "c:1": 100}), rules, opts)
    f = [f for f in allr.findings if f["rule"] == "queueing-saturation"][0]
    assert f["scope"] == "fleet" and f["kind"] == "capacity" and f["instances"] == ["a:1", "b:1", "c:1"]
    assert "lacks capacity" in f["summary"] and allr.per_instance["a:1"].incidents[0].causes[0].cause in f["summary"]
    # what "on every replica" means is the rule's word (fleet.on_every_replica), not fleet code's
    shared = [dataclasses.replace(r, fleet_everywhere="shared") if r.id == "queueing-saturation" else r for r in rules]
    f = [f for f in diagnose_fleet(_fleet({"a:1": 6, "b:1": 5, "c:1": 7}, {"a:1": 100, "b:1": 100, "c:1": 100}),
                                   shared, opts).findings if f["rule"] == "queueing-saturation"][0]
    assert f["kind"] == "shared" and "lacks capacity" not in f["summary"] and "a cause they share" in f["summary"]
    # a big fleet: the sentence names a few healthy replicas and counts the rest; JSON keeps all
    many = {f"r{i}:1": 0 for i in range(12)} | {"a:1": 6}
    big = diagnose_fleet(_fleet(many, {k: (300 if k == "a:1" else 100) for k in many}), rules, opts)
    f = [f for f in big.findings if f["rule"] == "queueing-saturation"][0]
    assert len(f["healthy"]) == 12 and "and 7 more" in f["summary"] and "r9:1" not in f["summary"]


class Canned:
    """Prometheus answers in the API's JSON shape, for the join rules' corner cases (Kubernetes
    label renames, DCGM's Hostname, two engines on one host). The real server is tested below."""
    url, queries, bytes = "canned", 0, 0

    def __init__(self, series: list[tuple[dict[str, str], float]]):
        self.series = series

    def label_values(self, label, match, start, end):
        return sorted({labels["__name__"] for labels, _ in self.series})

    def query_range(self, query, start, end, step_s):
        name = re.search(r'__name__="([^"]+)"', query)[1]
        n = int((end - start) / step_s) + 1
        return [{"metric": {k: v for k, v in labels.items() if k != "__name__"},
                 "values": [[start + i * step_s, str(value)] for i in range(n)]}
                for labels, value in self.series if labels["__name__"] == name]


def _vllm(**labels):
    return ({"__name__": "vllm:num_requests_running", **labels}, 4.0)


def _dcgm(active: float, **labels):
    return ({"__name__": "DCGM_FI_PROF_DRAM_ACTIVE", "gpu": "0", "modelName": "NVIDIA H100 80GB HBM3", **labels}, active)


def _active(d: FleetData, name: str) -> float | None:
    return d.samples[name][-1].values.get("gpu_dram_active_frac")


def test_dcgm_joins_by_pod_rename_hostname_or_address():
    # Kubernetes: the scrape target's pod label (the exporter's own pod) pushed dcgm-exporter's
    # pod label (the workload on that GPU) to exported_pod
    k8s = fetch(Canned([_vllm(pod="vllm-0", instance="10.1.0.4:8000"), _vllm(pod="vllm-1", instance="10.1.0.5:8000"),
                        _dcgm(0.9, pod="dcgm-exporter-abc", exported_pod="vllm-0", instance="10.1.0.9:9400"),
                        _dcgm(0.2, pod="dcgm-exporter-abc", exported_pod="vllm-1", instance="10.1.0.9:9400")]),
                0, 60, 15, group_by=("pod",))
    assert set(k8s.samples) == {"vllm-0", "vllm-1"} and not k8s.warnings
    assert (_active(k8s, "vllm-0"), _active(k8s, "vllm-1")) == (0.9, 0.2)
    assert k8s.joined == {"vllm-0": {"dcgm"}, "vllm-1": {"dcgm"}}
    # bare metal: same address, another port; or the exporter's Hostname label names the host
    bare = fetch(Canned([_vllm(instance="10.0.0.5:8000"), _vllm(instance="gpu-b:8000"),
                         _dcgm(0.7, instance="10.0.0.5:9400", Hostname="x"),
                         _dcgm(0.3, instance="dcgm.monitoring:9400", Hostname="gpu-b")]), 0, 60, 15)
    assert (_active(bare, "10.0.0.5:8000"), _active(bare, "gpu-b:8000")) == (0.7, 0.3) and not bare.warnings
    # two engines on one host and nothing that tells which GPU is whose: left out, said once
    amb = fetch(Canned([_vllm(instance="10.0.0.7:8000"), _vllm(instance="10.0.0.7:8001"),
                        _dcgm(0.5, instance="10.0.0.7:9400"), _dcgm(0.5, instance="10.0.0.7:9400", gpu="1")]), 0, 60, 15)
    assert all(_active(amb, n) is None for n in amb.samples) and not amb.joined
    assert len(amb.warnings) == 1 and "1 exporter target(s) (10.0.0.7:9400)" in amb.warnings[0]


def test_sidecar_joins_the_server_it_watches():
    series = [_vllm(instance="10.0.0.7:8000"), _vllm(instance="10.0.0.7:8001"),
              ({"__name__": "kvdoctor_info", "server": "http://10.0.0.7:8001", "engine": "vllm", "instance": "10.0.0.7:9401"}, 1),
              ({"__name__": "kvdoctor_incident_active", "rule": "kv-pressure-preemption", "instance": "10.0.0.7:9401"}, 1),
              ({"__name__": "kvdoctor_gpu_memory_bandwidth_ratio", "gpu": "0", "instance": "10.0.0.7:9401"}, 0.75)]
    d = fetch(Canned(series), 0, 60, 15)
    assert [e.detail["sidecar_incident"] for e in d.events["10.0.0.7:8001"]] == ["kv-pressure-preemption"]
    assert "10.0.0.7:8000" not in d.events and not d.warnings
    assert (_active(d, "10.0.0.7:8001"), _active(d, "10.0.0.7:8000")) == (0.75, None)


def _bandwidth_bound_instance(name: str, dram_active: float, n: int = 60) -> tuple[list[EngineSample], float]:
    """vLLM-like samples every 10 s: requests running cycle 1..16, each step's decodes take
    4 ms x running per token (bandwidth shared by the batch), DCGM DRAM activity alongside."""
    les = [0.01, 0.025, 0.05, 0.075, 0.1]
    cum, out = np.zeros(len(les)), []
    for i in range(n):
        running = 1 + (i * 7) % 16
        tpot = 0.004 * running
        cum += [20.0 if tpot <= le else 0.0 for le in les]
        out.append(EngineSample(time_s=i * 10.0, engine="vllm", server=name,
                                values={"requests_running": float(running), "requests_waiting": 0.0,
                                        "generation_tokens_total": 500.0 * i, "gpu_dram_active_frac": dram_active},
                                histograms={"tpot_seconds": {"le": les, "cum": list(cum), "sum": None, "count": 20.0 * (i + 1)}}))
    return out, (n - 1) * 10.0


def test_bandwidth_bound_decode_from_aggregated_metrics_and_dcgm():
    """No request records: TPOT per scrape interval (histogram increase) against requests
    running, and DRAM activity from DCGM, are enough for decode-bandwidth-bound and its cause."""
    d = FleetData(0.0, 590.0, 10.0, "test")
    for name, active in (("a:1", 0.9), ("b:1", 0.2)):
        d.samples[name], _ = _bandwidth_bound_instance(name, active)
        d.engines[name] = "vllm"
    fd = diagnose_fleet(d, load_rules(), Options(lookback_s=300, step_s=30))
    f = next(f for f in fd.findings if f["rule"] == "decode-bandwidth-bound")
    # b:1's TPOT grows as much, but DCGM measures its DRAM 20% busy: bandwidth is ruled out there
    assert f["instances"] == ["a:1"]
    causes = {n: [c for i in fd.per_instance[n].incidents for c in i.causes if c.rule.id == "decode-bandwidth-bound"]
              for n in ("a:1", "b:1")}
    assert not causes["b:1"]
    causes = {"a:1": causes["a:1"][0]}
    assert causes["a:1"].cause.startswith("Memory bandwidth is saturated")
    assert causes["a:1"].evidence["tpot_high_over_low_concurrency"] >= 3
    assert causes["a:1"].evidence["tpot_concurrency_corr"] > 0.8


def _prefix_fleet(hit_share: dict[str, float], n: int = 30) -> FleetData:
    d = FleetData(0.0, (n - 1) * 10.0, 10.0, "test")
    for name, share in hit_share.items():
        d.samples[name] = [EngineSample(time_s=i * 10.0, engine="vllm", server=name,
                                        values={"requests_running": 3.0, "requests_waiting": 0.0,
                                                "prefix_cache_queries_total": 5000.0 * i,
                                                "prefix_cache_hits_total": 5000.0 * i * share,
                                                "generation_tokens_total": 800.0 * i})
                           for i in range(n)]
        d.engines[name] = "vllm"
    return d


def test_replica_far_from_its_peers_is_an_outlier_finding():
    """No rule fires on a 3% prefix-cache hit rate alone (what is achievable needs request
    records), but against three peers at ~60% it is one replica's problem: named, with the
    peers' median as evidence."""
    rules, opts = load_rules(), Options(lookback_s=120, step_s=30)
    fd = diagnose_fleet(_prefix_fleet({"a:1": 0.61, "b:1": 0.58, "c:1": 0.03, "d:1": 0.63}), rules, opts)
    f = [f for f in fd.findings if f["kind"] == "outlier"]
    assert [(x["rule"], x["instances"]) for x in f] == [("outlier:prefix_hit_rate_achieved", ["c:1"])]
    assert f[0]["evidence"]["c:1"]["prefix_hit_rate_achieved"] == pytest.approx(0.03, abs=1e-3)
    assert f[0]["evidence"]["c:1"]["peers_median"] == pytest.approx(0.61, abs=1e-3)
    assert "prefix caching off" in f[0]["summary"]
    # the comparison is the rule's (prefix-cache-ineffective's fleet.outlier): without it, none
    bare = [dataclasses.replace(r, fleet_outlier=None) for r in rules]
    assert not [f for f in diagnose_fleet(_prefix_fleet({"a:1": 0.61, "b:1": 0.58, "c:1": 0.03, "d:1": 0.63}), bare,
                                          opts).findings if f["kind"] == "outlier"]
    # peers that differ a little, or a fleet with no baseline (two replicas), give nothing
    assert not [f for f in diagnose_fleet(_prefix_fleet({"a:1": 0.61, "b:1": 0.50, "c:1": 0.42}), rules, opts).findings
                if f["kind"] == "outlier"]
    assert not [f for f in diagnose_fleet(_prefix_fleet({"a:1": 0.61, "b:1": 0.03}), rules, opts).findings
                if f["kind"] == "outlier"]


def test_parallel_diagnosis_gives_the_same_answer():
    """Forty replicas diagnosed in two forked workers: the same findings, replica table and
    per-replica JSON as in one process."""
    waiting = {f"r{i:02d}:1": (6 if i in (3, 17) else 0) for i in range(40)}
    d = _fleet(waiting, {k: (300 if v else 100) for k, v in waiting.items()})
    rules, opts = load_rules(), Options(lookback_s=120, step_s=10)
    one, two = diagnose_fleet(d, rules, opts, workers=1).to_json(), diagnose_fleet(d, rules, opts, workers=2).to_json()
    for key in ("findings", "replicas", "instances"):
        assert json.dumps(one[key], sort_keys=True, default=str) == json.dumps(two[key], sort_keys=True, default=str), key
    assert [f["instances"] for f in one["findings"] if f["rule"] == "queueing-saturation"] == [["r03:1", "r17:1"]]


def test_a_server_that_never_answers_times_out_with_a_named_warning():
    """A listening socket that accepts and never answers (a hung Prometheus or proxy): the
    per-query timeout fires, the warning names the query and says it timed out."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    try:
        t = time.perf_counter()
        d = fetch(PromClient(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout_s=0.5), 0, 60, 15)
        assert time.perf_counter() - t < 5
        assert not d.samples and len(d.warnings) == 1
        assert "label/__name__/values" in d.warnings[0] and "timed out" in d.warnings[0].lower(), d.warnings
    finally:
        srv.close()


def test_unreachable_prometheus_is_a_warning_not_a_crash():
    d = fetch(PromClient("http://127.0.0.1:9", timeout_s=2), 0, 60, 15)
    assert not d.samples and any("cannot reach" in w for w in d.warnings)


# -- real Prometheus + two real llama-servers ------------------------------------------------------

PROM = Path("/usr/bin/prometheus")


def _prometheus_binary() -> Path | None:
    if not PROM.exists() and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "prometheus"], capture_output=True, timeout=600)
    return PROM if PROM.exists() else None


def _wait(url: str, timeout_s: float = 60) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


DCGM_FIXTURE = Path(__file__).parent / "data" / "metrics" / "datadog_dcgm_fixture_metrics.txt"
JOBS = {"selector": '{job="llama"}', "gpu_selector": '{job="dcgm"}', "sidecar_selector": '{job="kvdoctor"}'}


@pytest.fixture(scope="module")
def fleet_stack():
    """Two "hosts" on loopback (127.0.0.2, 127.0.0.3), each with a real llama-server and a DCGM
    exporter stand-in (a recorded dcgm-exporter scrape whose activity follows that server's busy
    slots); a real `kvdoctor attach` sidecar in front of the first, which gets 8 concurrent long
    prompts on 2 slots through it for 110 s (the sidecar's live rules need 20 finished requests and then hold
    30 s before an incident opens); the second gets a trickle. A real Prometheus scrapes all five
    targets as three jobs, the way a fleet runs them."""
    if _prometheus_binary() is None:
        pytest.skip("/usr/bin/prometheus absent (apt-get install -y prometheus failed)")
    from harness.dcgm_standin import DcgmStandIn
    from harness.llama_server import LlamaServer, free_port
    from harness.loadgen import long_prompts, run_load, short_prompts

    tmp = Path(tempfile.mkdtemp(prefix="kvd-fleet-"))
    with LlamaServer(parallel=2, threads=1, n_ctx=2048, host="127.0.0.2") as hot, \
            LlamaServer(parallel=2, threads=1, n_ctx=2048, host="127.0.0.3") as cool, \
            DcgmStandIn(DCGM_FIXTURE, "127.0.0.2", hot.url, 2, hostname="gpu-node-a") as dcgm_hot, \
            DcgmStandIn(DCGM_FIXTURE, "127.0.0.3", cool.url, 2, hostname="gpu-node-b") as dcgm_cool:
        proxy_port, side_port, port = free_port("127.0.0.2"), free_port("127.0.0.2"), free_port("127.0.0.1")
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "kvdoctor", "attach", "--server", hot.url, "--proxy", f"127.0.0.2:{proxy_port}",
             "--listen", f"127.0.0.2:{side_port}", "--capture", str(tmp / "sidecar"), "--gpu", "none",
             "--step", "2s", "-q"],
            stdout=subprocess.DEVNULL, stderr=open(tmp / "sidecar.log", "wb"))
        (tmp / "prom.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: llama\n    static_configs: [{{targets: ['{hot.host}:{hot.port}', '{cool.host}:{cool.port}']}}]\n"
            f"  - job_name: dcgm\n    static_configs: [{{targets: ['127.0.0.2:{dcgm_hot.port}', '127.0.0.3:{dcgm_cool.port}']}}]\n"
            f"  - job_name: kvdoctor\n    static_configs: [{{targets: ['127.0.0.2:{side_port}']}}]\n")
        prom = subprocess.Popen([str(PROM), f"--config.file={tmp / 'prom.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=open(tmp / "prom.log", "wb"))
        try:
            url = f"http://127.0.0.1:{port}"
            _wait(url + "/-/ready")
            _wait(f"http://127.0.0.2:{side_port}/healthz")

            def sidecar_opened():
                with urllib.request.urlopen(f"http://127.0.0.2:{side_port}/healthz", timeout=5) as r:
                    return json.loads(r.read())["open_incidents"] > 0

            def load():
                # at least 110 s of load, then until the sidecar's live rules have opened an incident
                # (20 finished requests + a 30 s hold: slower on a busy machine), 300 s at most
                async def both():
                    task = asyncio.ensure_future(asyncio.gather(
                        run_load(f"http://127.0.0.2:{proxy_port}", long_prompts(800, tokens=300, max_tokens=48),
                                 concurrency=8, timeout_s=120, max_duration_s=300),
                        run_load(cool.url, short_prompts(120, max_tokens=16), concurrency=1, arrival_rate_per_s=0.3,
                                 timeout_s=120, max_duration_s=300)))
                    t0 = time.monotonic()
                    while not task.done():
                        await asyncio.sleep(2)
                        if time.monotonic() - t0 >= 110 and await asyncio.to_thread(sidecar_opened):
                            break
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                asyncio.run(both())

            th = threading.Thread(target=load, daemon=True)
            th.start()
            th.join(timeout=360)
            time.sleep(3)  # last scrapes
            yield {"url": url, "hot": f"127.0.0.2:{hot.port}", "cool": f"127.0.0.3:{cool.port}", "tmp": tmp,
                   "sidecar": f"127.0.0.2:{side_port}"}
        finally:
            for p in (prom, sidecar):
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.server
@pytest.mark.slow
def test_queries_against_real_prometheus(fleet_stack):
    url, now = fleet_stack["url"], time.time()
    c = PromClient(url, timeout_s=30)
    sel = Selectors.parse(**JOBS)
    names = c.label_values("__name__", discovery_selectors(sel), now - 180, now)
    assert {"llamacpp:requests_deferred", "DCGM_FI_PROF_DRAM_ACTIVE", "kvdoctor_info"} <= set(names)
    planned = plan(names, sel)
    assert {p.table.name if p.table else "sidecar" for p in planned} == {"llamacpp", "dcgm", "sidecar"}
    assert len(planned) == len({p.name for p in planned})
    res = c.query_range(next(p.query for p in planned if p.name == "llamacpp:requests_deferred"), now - 120, now, 2)
    assert {r["metric"]["instance"] for r in res} == {fleet_stack["hot"], fleet_stack["cool"]}
    dram = c.query_range(next(p.query for p in planned if p.name == "DCGM_FI_PROF_DRAM_ACTIVE"), now - 120, now, 2)
    assert {r["metric"]["job"] for r in dram} == {"dcgm"} and len(dram) == 2
    with pytest.raises(PromError) as e:
        c.query_range("sum(", now - 60, now, 2)
    assert "sum(" in str(e.value) and "bad_data" in str(e.value)
    d = fetch(PromClient(url), now - 180, now, 2, sel)
    assert set(d.samples) == {fleet_stack["hot"], fleet_stack["cool"]}, d.warnings
    assert d.queries == 1 + len(planned)  # discovery + one per wire name, not per instance
    hot = [s.values.get("requests_waiting", 0) for s in d.samples[fleet_stack["hot"]]]
    assert max(hot) >= 2


@pytest.mark.server
@pytest.mark.slow
def test_dcgm_and_sidecar_series_join_their_engine_instance(fleet_stack):
    """DCGM targets (another job, another port) join the llama-server on the same address; the
    sidecar joins the server its kvdoctor_info names; nothing is left over."""
    now = time.time()
    d = fetch(PromClient(fleet_stack["url"]), now - 180, now, 2, Selectors.parse(**JOBS))
    assert not [w for w in d.warnings if "match" in w], d.warnings

    def dram(name):
        v = np.array([s.values.get("gpu_dram_active_frac", np.nan) for s in d.samples[name]])
        return v[np.isfinite(v)]

    hot, cool = dram(fleet_stack["hot"]), dram(fleet_stack["cool"])
    assert len(hot) > 20 and len(cool) > 20
    assert np.percentile(hot, 90) >= 0.8 > np.percentile(cool, 90)  # 2/2 slots busy vs a trickle
    assert all("gpu_mem_used_bytes" in s.values for s in d.samples[fleet_stack["cool"]][-5:])
    # the per-instance diagnosis sees DCGM as its GPU: bandwidth and memory signals have values
    diag = diagnose_fleet(d, load_rules(), Options(lookback_s=120, step_s=2)).per_instance[fleet_stack["hot"]]
    assert diag.values["mem_bw_util_p90"] >= 0.8
    bw = [c.evidence.get("mem_bw_util_p90") for i in diag.incidents for c in i.causes if "mem_bw_util_p90" in c.evidence]
    assert all(v >= 0.8 for v in bw)
    from kvdoctor.signals import Prepared
    w = Prepared(capture_for(d, fleet_stack["hot"])).window(d.start_s, d.end_s)
    assert 0.5 < w.value("gpu_mem_used_max_frac") < 0.85
    # the sidecar's own incidents are attributed to the server it watches, and only to it
    side = [e.detail["sidecar_incident"] for e in d.events.get(fleet_stack["hot"], [])]
    assert side, (fleet_stack["tmp"] / "sidecar.log").read_text()[-2000:]
    assert not d.events.get(fleet_stack["cool"])
    # one selector for every kind: DCGM and the sidecar are other jobs, so they are not fetched
    narrow = fetch(PromClient(fleet_stack["url"]), now - 180, now, 2, JOBS["selector"])
    assert narrow.samples and not narrow.events
    assert not any("gpu_dram_active_frac" in s.values for ss in narrow.samples.values() for s in ss)


@pytest.mark.server
@pytest.mark.slow
def test_readme_and_fleet_md_blocks_run_as_written(fleet_stack, tmp_path):
    """README.md's "A fleet, through Prometheus" block and docs/fleet.md's import and report
    blocks against the real Prometheus above, as a user runs them: the Prometheus address and
    the engine's job (vllm there, llama here) substituted, everything else as written."""
    import os

    import kvdoctor

    docs = Path(__file__).parents[1]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    def run_block(doc: str, after: str, fence: str = "```bash") -> str:
        block = re.search(re.escape(after) + r".*?" + re.escape(fence) + r"\n(.*?)```", (docs / doc).read_text(), re.S)[1]
        script = block.replace("http://prom:9090", fleet_stack["url"]).replace('{job="vllm"}', JOBS["selector"])
        assert script != block, block
        got = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
        assert got.returncode == 0, f"{doc}: {script}\n{got.stderr[-2000:]}"
        return got.stdout

    out = run_block("README.md", "### A fleet, through Prometheus")
    assert fleet_stack["hot"] in out and (tmp_path / "fleet.html").stat().st_size > 100_000, out[-2000:]
    assert len(kvdoctor.load(tmp_path / "cap").engine.time_s) > 0
    # docs/fleet.md: its first examples, then a saved range, then the page from Prometheus and from the saved range
    first = run_block("docs/fleet.md", "# Fleet mode", "```")
    assert json.loads(first[re.search(r"^\{", first, re.M).start():])["instances"]  # the text answer, then the JSON
    run_block("docs/fleet.md", "## Offline: `import prometheus-range`", "```")
    (tmp_path / "fleet.html").unlink()
    run_block("docs/fleet.md", "## The fleet page: `kvdoctor report --prometheus`", "```")
    assert (tmp_path / "fleet.html").stat().st_size > 100_000


@pytest.mark.server
@pytest.mark.slow
def test_diagnose_names_only_the_overloaded_instance(fleet_stack, run_cli):
    sel = [a for k, v in JOBS.items() for a in ("--" + k.replace("_", "-"), v)]
    r = run_cli("diagnose", "--prometheus", fleet_stack["url"], "--since", "3m", "--step", "2s", *sel, "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    q = [f for f in out["findings"] if f["rule"] == "queueing-saturation"]
    assert q, out["findings"]
    assert q[0]["instances"] == [fleet_stack["hot"]] and q[0]["scope"] == "replica"
    assert all(fleet_stack["cool"] not in f["instances"] for f in out["findings"])
    assert not out["instances"][fleet_stack["cool"]]["incidents"]
    assert set(out["fleet"]["instances"]) == {fleet_stack["hot"], fleet_stack["cool"]}  # no DCGM/sidecar "instances"
    text = run_cli("diagnose", "--prometheus", fleet_stack["url"], "--since", "3m", "--step", "2s", *sel)
    assert text.returncode == 0 and "queueing-saturation [replica/" in text.stdout and fleet_stack["hot"] in text.stdout
    hot_line = next(x for x in text.stdout.splitlines() if x.strip().startswith(fleet_stack["hot"] + " ("))
    assert "sidecar reported:" in hot_line and "(llamacpp + dcgm + sidecar)" in hot_line
    assert out["fleet"]["joined"] == {fleet_stack["hot"]: ["dcgm", "sidecar"], fleet_stack["cool"]: ["dcgm"]}


def test_auto_step_follows_range_and_scrape_interval():
    from kvdoctor.prometheus.query import auto_step, auto_window

    assert auto_step(600, 1.0) == 1  # a 10-minute range keeps every 1 s scrape
    assert auto_step(600, None) == 15  # Prometheus' default interval when the server does not say
    assert auto_step(86400, 15.0) == 144  # a day: coarser only as far as ~600 points need
    lookback, step = auto_window(600, 1.0, 300)
    assert lookback == 120 and step == 30  # a fifth of the range, windows overlapping 4 to 1
    assert auto_window(600, 60.0, 300)[0] == 480  # never fewer than 8 samples a window


@pytest.mark.server
@pytest.mark.slow
def test_short_range_keeps_the_scrapes_and_says_when_too_thin(fleet_stack, run_cli):
    """`--since 10m` without --step: the step is the real Prometheus' scrape interval (1 s here),
    not 60 s, and the ~2-minute overload on one server is named; a step too coarse for the range
    is said to be too thin to judge instead of passing for healthy."""
    sel = [a for k, v in JOBS.items() for a in ("--" + k.replace("_", "-"), v)]
    r = run_cli("diagnose", "--prometheus", fleet_stack["url"], "--since", "10m", *sel, "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fleet"]["step_auto"] is True and out["fleet"]["scrape_interval_s"] == 1.0
    assert out["fleet"]["step_s"] == 1.0
    q = [f for f in out["findings"] if f["rule"] == "queueing-saturation"]
    assert q and q[0]["instances"] == [fleet_stack["hot"]], out["findings"]
    assert not any("too thin" in w for w in out["fleet"]["warnings"])
    thin = run_cli("diagnose", "--prometheus", fleet_stack["url"], "--since", "10m", "--step", "2m", *sel,
                   "--format", "json")
    assert thin.returncode == 0, thin.stderr
    warned = [w for w in json.loads(thin.stdout)["fleet"]["warnings"] if "too thin to judge" in w]
    assert warned and fleet_stack["hot"] in warned[-1] and "too thin to judge" in thin.stderr


@pytest.mark.server
@pytest.mark.slow
def test_import_prometheus_range_and_replay(fleet_stack, run_cli):
    cap = fleet_stack["tmp"] / "cap"
    r = run_cli("import", "prometheus-range", fleet_stack["url"], "-o", str(cap), "--opt", "since=3m",
                "--opt", "step=2s", *[a for k, v in JOBS.items() for a in ("--opt", f"{k}={v}")])
    assert r.returncode == 0, r.stderr
    d = from_capture(cap)
    assert set(d.samples) == {fleet_stack["hot"], fleet_stack["cool"]}
    assert any("gpu_dram_active_frac" in s.values for s in d.samples[fleet_stack["hot"]])
    r = run_cli("diagnose", "--prometheus", str(cap), "--step", "2s", "--format", "json")
    assert r.returncode == 0, r.stderr
    q = [f for f in json.loads(r.stdout)["findings"] if f["rule"] == "queueing-saturation"]
    assert q and q[0]["instances"] == [fleet_stack["hot"]]
    page = fleet_stack["tmp"] / "fleet.html"
    r = run_cli("report", "--prometheus", str(cap), "--step", "2s", "-o", str(page))
    assert r.returncode == 0 and "2 replicas, 1 flagged" in r.stdout, (r.stdout, r.stderr)
    html = page.read_text()
    assert fleet_stack["hot"] in html and 'id="chart-load"' in html and "queueing-saturation" in html


@pytest.mark.server
def test_tls_and_basic_auth_against_real_prometheus(tmp_path):
    """Prometheus behind TLS (self-signed, CA file given) and basic auth: the client gets in with
    the right credentials and says why not with wrong ones or without the CA."""
    if _prometheus_binary() is None:
        pytest.skip("/usr/bin/prometheus absent (apt-get install -y prometheus failed)")
    bcrypt = pytest.importorskip("bcrypt")
    from harness.llama_server import free_port
    from kvdoctor.prometheus import PromClient, PromError

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    (tmp_path / "web.yml").write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                                      f"basic_auth_users:\n  kvd: '{hashed}'\n")
    (tmp_path / "prom.yml").write_text("global: {scrape_interval: 1s}\nscrape_configs: []\n")
    port = free_port("127.0.0.1")
    prom = subprocess.Popen([str(PROM), f"--config.file={tmp_path / 'prom.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", f"--web.config.file={tmp_path / 'web.yml'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"https://127.0.0.1:{port}"
        ok = PromClient(url, basic_auth="kvd:s3cret", ca_file=str(cert), timeout_s=5)
        end = time.time() + 30
        while True:
            try:
                ok.query_range("vector(1)", time.time() - 60, time.time(), 15)
                break
            except PromError:
                if time.time() > end:
                    raise
                time.sleep(0.5)
        with pytest.raises(PromError, match="401|nauthori"):
            PromClient(url, basic_auth="kvd:wrong", ca_file=str(cert), timeout_s=5).query_range("vector(1)", time.time() - 60, time.time(), 15)
        with pytest.raises(PromError, match="(?i)certificate|ssl"):
            PromClient(url, basic_auth="kvd:s3cret", timeout_s=5).query_range("vector(1)", time.time() - 60, time.time(), 15)
        assert PromClient(url, basic_auth="kvd:s3cret", insecure=True, timeout_s=5).query_range(
            "vector(1)", time.time() - 60, time.time(), 15)
    finally:
        prom.terminate()
        prom.wait(10)


RECORDED_PAGES = {  # job -> (recorded /metrics page in tests/data/metrics, engine table it must map to)
    "vllm": ("vllm_v0_qwen2.5-coder-1.5b_aibrix_runtime_doc.prom", "vllm"),
    "sglang-old": ("sglang_gemma-2-9b-it_production_metrics_doc_early.prom", "sglang"),
    "sglang": ("sglang_llama3.1-8b_production_metrics_doc.prom", "sglang"),
    "trtllm": ("trtllm_triton_backend_readme_metrics.prom", "trtllm"),
}


@pytest.mark.server
def test_every_engines_recorded_page_through_a_real_prometheus(tmp_path):
    """Real /metrics pages of vLLM, SGLang (two generations of names) and TensorRT-LLM (Triton),
    served as recorded and scraped by a real Prometheus: discovery finds their names, one query
    per name comes back, and each job maps to its engine table with the core gauges."""
    import functools
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    from harness.llama_server import free_port

    if _prometheus_binary() is None:
        pytest.skip("/usr/bin/prometheus absent (scripts/install-services installs it)")
    quiet = type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    pages = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(quiet, directory=str(DCGM_FIXTURE.parent)))
    threading.Thread(target=pages.serve_forever, daemon=True).start()
    jobs = "".join(f"  - job_name: {job}\n    metrics_path: /{page}\n"
                   f"    static_configs: [{{targets: ['127.0.0.1:{pages.server_address[1]}']}}]\n"
                   for job, (page, _) in RECORDED_PAGES.items())
    (tmp_path / "prom.yml").write_text(f"global: {{scrape_interval: 1s}}\nscrape_configs:\n{jobs}")
    port = free_port()
    prom = subprocess.Popen([str(PROM), f"--config.file={tmp_path / 'prom.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(url + "/-/ready")
        time.sleep(6)  # a few scrapes of every job
        now = time.time()
        d = fetch(PromClient(url), now - 60, now, 1, None, group_by=("job",))
        assert d.engines == {job: engine for job, (_, engine) in RECORDED_PAGES.items()}, (d.engines, d.warnings)
        assert not d.warnings, d.warnings
        for job in RECORDED_PAGES:
            last = d.samples[job][-1].values
            assert "requests_running" in last and ("kv_usage_frac" in last or "kv_used_blocks" in last), (job, sorted(last))
        assert d.samples["sglang"][-1].histograms.get("ttft_seconds"), sorted(d.samples["sglang"][-1].histograms)
    finally:
        pages.shutdown()
        prom.terminate()
        prom.wait(10)


@pytest.mark.server
def test_a_failed_query_is_named_and_the_rest_goes_on(run_cli):
    """A real Prometheus with a low --query.max-samples refuses the big histogram-bucket query
    (6 instances x 9 buckets x 121 steps) but answers the gauges: the warning names the query and
    Prometheus' reason, and the diagnosis still names the sick replica from what came back."""
    from harness.fleetdata import PrometheusOnBlocks, instance_name

    if _prometheus_binary() is None:
        pytest.skip("/usr/bin/prometheus absent (scripts/install-services installs it)")
    with PrometheusOnBlocks(6, 2, {2}, dcgm=True, extra_args=("--query.max-samples=3000",)) as prom:
        r = run_cli("diagnose", "--prometheus", prom.url, "--start", str(prom.start_s), "--end", str(prom.end_s),
                    "--step", "1m", "--selector", '{job="vllm"}', "--gpu-selector", '{job="dcgm"}', "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    failed = [w for w in out["fleet"]["warnings"] if "time_to_first_token_seconds_bucket" in w]
    assert len(failed) == 1 and "too many samples" in failed[0] and failed[0] in r.stderr
    assert len(out["fleet"]["warnings"]) == 1  # the gauges, counters and DCGM series all came back
    q = [f for f in out["findings"] if f["rule"] == "queueing-saturation"]
    assert q and q[0]["instances"] == [instance_name(2)]
    assert len(out["fleet"]["instances"]) == 6 and all(j == ["dcgm"] for j in out["fleet"]["joined"].values())


@pytest.mark.server
def test_bearer_token_against_a_gated_prometheus(tmp_path, run_cli):
    """Hosted Prometheus-compatible APIs (Mimir or Thanos gateways, Grafana Cloud, a reverse proxy)
    take a bearer token. Here a real nginx in front of a real Prometheus refuses any request
    without `Authorization: Bearer <token>`; the token comes from --bearer-token or
    $KVDOCTOR_PROM_TOKEN and is never printed."""
    from harness.llama_server import free_port
    from harness.nginx import write_conf

    if _prometheus_binary() is None:
        pytest.skip("/usr/bin/prometheus absent (apt-get install -y prometheus failed)")
    prom_port, gate_port, token = free_port(), free_port(), "kvd-test-token-8d1f"
    cmd = write_conf(tmp_path, f"""
    server {{
        listen 127.0.0.1:{gate_port};
        location / {{
            if ($http_authorization != "Bearer {token}") {{ return 401 "unauthorized\\n"; }}
            proxy_pass http://127.0.0.1:{prom_port};
        }}
    }}""")
    if not cmd:
        pytest.skip("nginx absent (scripts/install-services installs nginx-light)")
    # a recorded vLLM /metrics page, served as it was scraped, stands for the engine behind it
    import functools
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    quiet = type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    page = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(quiet, directory=str(DCGM_FIXTURE.parent)))
    threading.Thread(target=page.serve_forever, daemon=True).start()
    (tmp_path / "prom.yml").write_text(
        f"global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: vllm\n"
        f"    metrics_path: /vllm_v0_qwen2.5-coder-1.5b_aibrix_runtime_doc.prom\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{page.server_address[1]}']}}]\n")
    procs = [subprocess.Popen([str(PROM), f"--config.file={tmp_path / 'prom.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
                               f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
             subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait(f"http://127.0.0.1:{prom_port}/-/ready")
        url = f"http://127.0.0.1:{gate_port}"
        ok = PromClient(url, bearer_token=token, timeout_s=5)
        end = time.time() + 30
        while True:
            try:
                if ok.query_range('vllm:num_requests_running', time.time() - 60, time.time(), 1):
                    break
            except PromError:
                pass
            if time.time() > end:
                raise TimeoutError("no vLLM series through the gate")
            time.sleep(0.5)
        for bad in (None, "wrong"):
            with pytest.raises(PromError, match="401"):
                PromClient(url, bearer_token=bad, timeout_s=5).query_range("up", time.time() - 60, time.time(), 1)
        # the CLI: token from the environment; a refused one is a named warning, not a traceback
        env_ok = run_cli("diagnose", "--prometheus", url, "--since", "1m", "--step", "5s", "--format", "json",
                         env_extra={"KVDOCTOR_PROM_TOKEN": token})
        assert env_ok.returncode == 0, env_ok.stderr
        assert json.loads(env_ok.stdout)["fleet"]["instances"] == [f"127.0.0.1:{page.server_address[1]}"]
        assert "HTTP 401" not in env_ok.stderr  # not a bare "401": a port number can hold it
        refused = run_cli("diagnose", "--prometheus", url, "--since", "1m", "--step", "5s", "--bearer-token", "wrong")
        assert refused.returncode == 4 and "nothing to diagnose" in refused.stderr.splitlines()[-1]
        assert "HTTP 401" in refused.stderr and "Traceback" not in refused.stderr and "wrong" not in refused.stderr
    finally:
        page.shutdown()
        for p in procs:
            p.terminate()
            p.wait(10)


HOSTILE_NAME = '<img src=x onerror="window.__pwned=1">:8000'


def test_fleet_page_has_findings_charts_and_escapes_label_values(tmp_path):
    """The fleet page from a diagnosis whose instance label is markup (Prometheus label values
    can hold anything): findings and table name the replicas, both charts are drawn, and the
    markup appears only escaped."""
    from kvdoctor.report.fleet_html import render_fleet_html

    d = _fleet({"a:1": 0, "b:1": 0, "c:1": 0, HOSTILE_NAME: 6}, {"a:1": 100, "b:1": 100, "c:1": 100, HOSTILE_NAME: 300})
    fd = diagnose_fleet(d, load_rules(), Options(lookback_s=120, step_s=10))
    rows = fd.to_json()["replicas"]
    assert rows[0]["instance"] == HOSTILE_NAME and rows[0]["status"] == "rule" and rows[0]["findings"]
    assert {r["status"] for r in rows[1:]} == {"healthy"}
    html = render_fleet_html(fd)
    assert "<img src=x" not in html and "&lt;img src=x onerror=" in html
    assert 'id="chart-load"' in html and 'id="chart-heatmap"' in html and "queueing-saturation" in html
    (tmp_path / "fleet.html").write_text(html)
