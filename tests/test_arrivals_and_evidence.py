"""Outputs say what was not measured: a capture without send times has no time axis (no rates,
no per-minute error rates), and unmeasured evidence is one "not measured" line, never "= n/a"."""
from __future__ import annotations

import json

from conftest import ROOT

LLMPERF = ROOT / "tests" / "data" / "traces" / "llmperf"


def test_llmperf_without_send_times_has_no_made_up_time_axis(tmp_path, run_cli):
    out = tmp_path / "cap"
    assert run_cli("import", "llmperf", LLMPERF / "bedrock_70b.json", "-o", out).returncode == 0
    assert json.loads((out / "meta.json").read_text())["arrivals_known"] is False  # the importer says so
    text = run_cli("diagnose", out)
    assert text.returncode == 0, text.stderr
    head = "\n".join(text.stdout.splitlines()[:3])  # the verdict, the first step, the context
    assert "arrival times unknown" in head and "+149s" not in text.stdout and " min)" not in head
    assert "request_rate_per_s" not in text.stdout  # a rate needs a clock
    doc = json.loads(run_cli("diagnose", out, "--format", "json").stdout)
    cap = doc["capture"]
    assert cap["arrivals_known"] is False and cap["start_s"] is None and cap["end_s"] is None
    assert any("arrival times unknown" in w for w in cap["warnings"])
    summary = run_cli("summary", out).stdout
    assert "warning: arrival times unknown" in summary


def test_time_signals_unknown_without_arrivals(tmp_path, run_cli):
    import kvdoctor
    from kvdoctor.diagnosis import diagnose

    out = tmp_path / "cap"
    assert run_cli("import", "llmperf", LLMPERF / "anyscale_7b.json", "-o", out).returncode == 0
    diag = diagnose(kvdoctor.load(out))
    w = diag.prepared.window(diag.start_s, diag.end_s)
    for name in ("request_rate_per_s", "output_tokens_per_s", "error_rate_max_1m", "load_change_frac"):
        assert w.value(name) != w.value(name), name  # NaN: unknown
    assert w.value("ttft_p50_s") > 0 and w.value("errors") == 0  # what does not need time stays


def test_unmeasured_evidence_is_one_line(run_cli):
    """samples/busy-host (real llama-server): decode-stall-tail lists the preemption rate, which a
    llama-server scrape does not give."""
    from kvdoctor.report.labels import label

    sample = ROOT / "samples" / "busy-host"
    doc = json.loads(run_cli("diagnose", sample, "--format", "json").stdout)
    cause = next(c for i in doc["incidents"] for c in i["causes"] if c["rule"] == "decode-stall-tail")
    nulls = [k for k, v in cause["evidence"].items() if v["value"] is None]
    assert "preemptions_per_min" in nulls and cause["not_measured"] == nulls  # JSON keeps the fields (null) and lists them
    for fmt in ("text", "markdown"):
        out = run_cli("diagnose", sample, "--format", fmt).stdout
        assert "n/a" not in out
        # the full text names identifiers (it is the verbose form); Markdown the labels people read
        assert all((name if fmt == "text" else label(name)) in out for name in nulls), out
        assert ("not measured: " if fmt == "text" else "Not measured: ") in out


def test_rules_judged_once_over_the_file_without_a_clock(tmp_path, run_cli):
    """Without send times a rule's `for:` hold cannot be measured; the request index must not
    stand in for seconds (40 requests would otherwise be "40 s", short of tail-latency's 1m)."""
    rows = json.loads((LLMPERF / "anyscale_7b.json").read_text())[:40]
    src = tmp_path / "head_individual_responses.json"
    src.write_text(json.dumps(rows))
    out = tmp_path / "cap"
    assert run_cli("import", "llmperf", src, "-o", out).returncode == 0
    slo = sorted(r["ttft_s"] for r in rows)[len(rows) // 2]  # an objective the P99 exceeds
    doc = json.loads(run_cli("diagnose", out, "--slo", f"ttft_p99={slo * 1000:.0f}ms", "--format", "json").stdout)
    (inc,) = [i for i in doc["incidents"] if i["causes"][0]["rule"] == "objective-ttft"]
    assert (inc["start"], inc["end"], inc["start_s"]) == ("#1", "#40", None)
    # a rule held for a minute (tail-latency, for: 1m) still fires, judged once over the file
    doc = json.loads(run_cli("diagnose", out, "--set", "tail-latency.min_ratio=1.01", "--format", "json").stdout)
    (inc,) = [i for i in doc["incidents"] if any(c["rule"] == "tail-latency" for c in i["causes"])]
    assert (inc["start"], inc["end"], inc["start_s"]) == ("#1", "#40", None)
