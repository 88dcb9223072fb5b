"""Fleet mode (kvdoctor/fleet): query building, mapping, fleet findings; and end to end against a
real Prometheus scraping two real llama-servers, one overloaded on purpose."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvdoctor.diagnosis import Options, load_rules
from kvdoctor.errors import InputError
from kvdoctor.fleet import PromClient, PromError, diagnose_fleet, fetch, from_capture
from kvdoctor.fleet.fleet import FleetData
from kvdoctor.fleet.query import discovery_selector, plan, selector_matchers, time_range
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
    assert 'job="x"' in discovery_selector('job="x"') and "vllm:.*" in discovery_selector("")


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


@pytest.fixture(scope="module")
def fleet_stack():
    if _prometheus_binary() is None:
        pytest.skip("/usr/bin/prometheus absent (apt-get install -y prometheus failed)")
    from kvdoctor.testing.llama_server import LlamaServer, free_port
    from kvdoctor.testing.loadgen import long_prompts, run_load, short_prompts

    tmp = Path(tempfile.mkdtemp(prefix="kvd-fleet-"))
    with LlamaServer(parallel=2, threads=1, n_ctx=2048) as hot, LlamaServer(parallel=2, threads=1, n_ctx=2048) as cool:
        port = free_port("127.0.0.1")
        (tmp / "prom.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n  - job_name: llama\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{hot.port}', '127.0.0.1:{cool.port}']\n")
        prom = subprocess.Popen([str(PROM), f"--config.file={tmp / 'prom.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=open(tmp / "prom.log", "wb"))
        try:
            url = f"http://127.0.0.1:{port}"
            _wait(url + "/-/ready")

            def load():
                async def both():
                    await asyncio.gather(
                        run_load(hot.url, long_prompts(400, tokens=300, max_tokens=48), concurrency=8,
                                 timeout_s=120, max_duration_s=75),
                        run_load(cool.url, short_prompts(60, max_tokens=16), concurrency=1, arrival_rate_per_s=0.3,
                                 timeout_s=120, max_duration_s=75))
                asyncio.run(both())

            th = threading.Thread(target=load, daemon=True)
            th.start()
            th.join(timeout=150)
            time.sleep(3)  # last scrapes
            yield {"url": url, "hot": f"127.0.0.1:{hot.port}", "cool": f"127.0.0.1:{cool.port}", "tmp": tmp}
        finally:
            prom.terminate()
            try:
                prom.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom.kill()
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.server
@pytest.mark.slow
def test_queries_against_real_prometheus(fleet_stack):
    url, now = fleet_stack["url"], time.time()
    c = PromClient(url, timeout_s=30)
    names = c.label_values("__name__", [discovery_selector('job="llama"')], now - 180, now)
    assert "llamacpp:requests_deferred" in names
    planned = plan(names, 'job="llama"')
    assert all(p.table.name == "llamacpp" for p in planned) and len(planned) == len({p.name for p in planned})
    res = c.query_range(next(p.query for p in planned if p.name == "llamacpp:requests_deferred"), now - 120, now, 2)
    assert {r["metric"]["instance"] for r in res} == {fleet_stack["hot"], fleet_stack["cool"]}
    with pytest.raises(PromError) as e:
        c.query_range("sum(", now - 60, now, 2)
    assert "sum(" in str(e.value) and "bad_data" in str(e.value)
    d = fetch(PromClient(url), now - 180, now, 2, '{job="llama"}')
    assert set(d.samples) == {fleet_stack["hot"], fleet_stack["cool"]}
    assert d.queries == 1 + len(planned)  # discovery + one per wire name, not per instance
    hot = [s.values.get("requests_waiting", 0) for s in d.samples[fleet_stack["hot"]]]
    assert max(hot) >= 2


@pytest.mark.server
@pytest.mark.slow
def test_diagnose_names_only_the_overloaded_instance(fleet_stack, run_cli):
    r = run_cli("diagnose", "--prometheus", fleet_stack["url"], "--since", "3m", "--step", "2s",
                "--selector", '{job="llama"}', "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    q = [f for f in out["findings"] if f["rule"] == "queueing-saturation"]
    assert q, out["findings"]
    assert q[0]["instances"] == [fleet_stack["hot"]] and q[0]["scope"] == "replica"
    assert all(fleet_stack["cool"] not in f["instances"] for f in out["findings"])
    assert not out["instances"][fleet_stack["cool"]]["incidents"]
    text = run_cli("diagnose", "--prometheus", fleet_stack["url"], "--since", "3m", "--step", "2s")
    assert text.returncode == 0 and f"queueing-saturation [replica/" in text.stdout and fleet_stack["hot"] in text.stdout


@pytest.mark.server
@pytest.mark.slow
def test_import_prometheus_range_and_replay(fleet_stack, run_cli):
    from kvdoctor import importers
    from kvdoctor.importers.base import write_capture

    cap = fleet_stack["tmp"] / "cap"
    imp = importers.get("prometheus-range").read([], {"prometheus": fleet_stack["url"], "since": "3m", "step": "2s"})
    assert write_capture(imp, cap) > 0
    d = from_capture(cap)
    assert set(d.samples) == {fleet_stack["hot"], fleet_stack["cool"]}
    r = run_cli("diagnose", "--prometheus", str(cap), "--step", "2s", "--format", "json")
    assert r.returncode == 0, r.stderr
    q = [f for f in json.loads(r.stdout)["findings"] if f["rule"] == "queueing-saturation"]
    assert q and q[0]["instances"] == [fleet_stack["hot"]]


@pytest.mark.server
def test_tls_and_basic_auth_against_real_prometheus(tmp_path):
    """Prometheus behind TLS (self-signed, CA file given) and basic auth: the client gets in with
    the right credentials and says why not with wrong ones or without the CA."""
    if _prometheus_binary() is None:
        pytest.skip("/usr/bin/prometheus absent (apt-get install -y prometheus failed)")
    bcrypt = pytest.importorskip("bcrypt")
    from kvdoctor.fleet.client import PromClient, PromError
    from kvdoctor.testing.llama_server import free_port

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
