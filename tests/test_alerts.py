"""Alert rules that ship (alerts/, kvdoctor/alerts): generated from the rules and engine tables,
up to date, valid for a real promtool, and passing promtool's alerting unit tests per engine."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvdoctor.alerts import export as E
from kvdoctor.alerts import promql
from kvdoctor.diagnosis import conditions as C
from kvdoctor.diagnosis import load_rules
from kvdoctor.engines import ENGINES
from kvdoctor.signals import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "alerts"
PROMTOOL = shutil.which("promtool")


def _cond(spec):
    return C.parse(spec, "t", set(REGISTRY), {"n": 3.0})


def test_unknown_leaves_are_false_as_in_kvdoctor():
    """A leaf without a PromQL form drops out of an ``any`` and fails an ``all``; an SLO leaf
    needs the SLO; parameters and factors are substituted."""
    vllm = ENGINES["vllm"]
    u: set[str] = set()
    got = E.translate(_cond({"any": ["requests_waiting_p50 >= param.n", "queue_share_p50 >= 0.3"]}), vllm, "5m", {}, {"n": 3.0}, u)
    assert got == "(quantile_over_time(0.5, (sum by (job, instance) (vllm:num_requests_waiting))[5m:])) >= 3"
    assert u == {"queue_share_p50"}
    assert E.translate(_cond({"all": ["requests_waiting_p50 >= 1", "queue_share_p50 >= 0.3"]}), vllm, "5m", {}, {}, set()) is None
    assert E.translate(_cond("ttft_p99_s > slo.ttft_p99_s"), vllm, "5m", {}, {}, set()) is None
    slo = E.translate(_cond("ttft_p99_s > 2 * slo.ttft_p99_s"), vllm, "1m", {"ttft_p99_s": 0.5}, {}, set())
    assert slo.endswith(" > 1") and "vllm:time_to_first_token_seconds_bucket[1m]" in slo
    # an engine without the metric: unknown there
    assert E.translate(_cond("preemptions_per_min > 0"), ENGINES["llamacpp"], "5m", {}, {}, set()) is None


def test_selectors_follow_the_engine_tables():
    """Label-split wire names exclude the values earlier entries took; counters without _total
    (TGI's exporter) also match the newer _total spelling; v0 and v1 names are alternatives."""
    assert promql.selectors(ENGINES["vllm"], "request_success_total") == [
        'vllm:request_success_total{finished_reason!="abort",finished_reason!="error"}']
    assert promql.selectors(ENGINES["tgi"], "request_failure_total") == ["tgi_request_failure", "tgi_request_failure_total"]
    assert promql.selectors(ENGINES["vllm"], "kv_usage_frac") == ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]
    assert promql.selectors(ENGINES["llamacpp"], "requests_waiting") == []  # llama.cpp's queue is requests_deferred
    assert "llamacpp:requests_deferred" in promql.signal("requests_waiting_p50", ENGINES["llamacpp"], "5m")


_NAME = re.compile(r"\b([a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+|(?:tgi|trtllm|nv_trt_llm|kvdoctor)_[a-zA-Z0-9_]+)\b")


def test_shipped_files_only_name_metrics_of_their_engine_table():
    for t in E.ENGINES:
        doc = yaml.safe_load((ALERTS / f"{t.name}.yaml").read_text())
        known = {w.wire for w in t.metrics}
        known |= {n + "_total" for n in known} | {n + "_bucket" for n in known}
        names = {m for r in doc["groups"][0]["rules"] for m in _NAME.findall(r["expr"])}
        assert names and names <= known, (t.name, names - known)
        alerts = {r["alert"] for r in doc["groups"][0]["rules"]}
        assert {"KvdoctorQueueingSaturation", "KvdoctorServerDown"} <= alerts, t.name
        for r in doc["groups"][0]["rules"]:
            assert r["for"] and r["labels"]["severity"] in ("critical", "warning", "info")
            assert r["annotations"]["runbook_url"].startswith(E.RUNBOOK_BASE + "#")
            assert "{{ $value" in r["annotations"]["summary"] or r["alert"] == "KvdoctorServerDown"
            anchor = r["annotations"]["runbook_url"].split("#")[1]
            assert f"\n## {anchor}\n" in (ROOT / "docs" / "runbooks.md").read_text()


def test_shipped_files_are_the_export_output(run_cli, tmp_path):
    r = run_cli("rules", "export", "--format", "prometheus", "-o", str(ALERTS), "--runbooks", str(ROOT / "docs" / "runbooks.md"),
                "--check")
    assert r.returncode == 0, r.stderr + "\nregenerate: kvdoctor rules export --format prometheus -o alerts/ --runbooks docs/runbooks.md"
    # the check can fail: a hand edit is caught
    shutil.copytree(ALERTS, tmp_path / "a")
    p = tmp_path / "a" / "vllm.yaml"
    p.write_text(p.read_text().replace("for: 2m", "for: 1m", 1))
    r = run_cli("rules", "export", "--format", "prometheus", "-o", str(tmp_path / "a"), "--check")
    assert r.returncode == 1 and "out of date: " in r.stderr and "vllm.yaml" in r.stderr


def test_export_options_and_what_cannot_be_expressed(run_cli, tmp_path):
    r = run_cli("rules", "export", "--format", "prometheus", "--window", "30s", "--for", "10s", "--slo", "ttft_p99=500ms")
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(r.stdout)
    rules = [x for g in doc["groups"] for x in g["rules"]]
    assert {x["for"] for x in rules} == {"10s"}
    assert all("[5m" not in x["expr"] for x in rules)
    ttft = next(x for x in rules if x["alert"] == "KvdoctorTTFTP99OverSLO" and x["labels"]["engine"] == "vllm")
    assert ttft["expr"].endswith("> 0.5")
    # said on stderr: which rules have no PromQL form, and why
    assert re.search(r"^prefill-bound: not expressible in PromQL \(.*ttft_prompt_corr.*\)$", r.stderr, re.M)
    assert "kv-pressure-preemption on llamacpp: not expressible in PromQL (no llamacpp metric for preemptions_per_min)" in r.stderr
    bad = run_cli("rules", "export", "--format", "prometheus", "--window", "5 minutes")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--window '5 minutes'" in bad.stderr


def test_shipped_holds_are_at_least_the_rules_and_two_minutes():
    rules = {r.id: r for r in load_rules()}
    for t in E.ENGINES:
        doc = yaml.safe_load((ALERTS / f"{t.name}.yaml").read_text())
        for r in doc["groups"][0]["rules"]:
            rid = r["labels"]["kvdoctor_rule"]
            hold = {"m": 60, "s": 1}[r["for"][-1]] * int(r["for"][:-1])
            if rid in rules and r["alert"] == E.camel(rid):
                assert hold >= max(rules[rid].for_s, E.MIN_FOR_S)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool absent (scripts/install-services installs Debian's prometheus)")
def test_promtool_check_and_unit_tests():
    files = sorted(ALERTS.glob("*.yaml"))
    assert len(files) == len(E.ENGINES) + 1
    r = subprocess.run([PROMTOOL, "check", "rules", *map(str, files)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    tests = sorted((ALERTS / "tests").glob("*.test.yaml"))
    assert {p.name.removesuffix(".test.yaml") for p in tests} == {p.stem for p in files}  # one per file
    r = subprocess.run([PROMTOOL, "test", "rules", *map(str, tests)], capture_output=True, text=True, timeout=300, cwd=ALERTS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(tests)
