"""The error classifier (kvdoctor/error_classes.py) on real error texts and real runs: each class
ends in its own cause and fix, cancellations and client flags are not failures."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvdoctor
from kvdoctor import error_classes
from kvdoctor.diagnosis import diagnose

from conftest import ROOT

DATA = Path(__file__).parent / "data" / "traces"


def _errors(capture: Path) -> list[dict]:
    rows = [json.loads(x) for f in sorted(capture.glob("requests-*.jsonl")) for x in f.read_text().splitlines() if x]
    return [r for r in rows if r.get("error")]


def test_real_texts_classified():
    # llama-server's own 400s in the context-overflow sample (recorded through the proxy)
    ctx = _errors(ROOT / "samples" / "context-overflow")
    assert ctx and all(error_classes.classify(r.get("http_status"), None, r["error"], r["status"]) == "context_overflow"
                       for r in ctx)
    # AIPerf's client cancellations and llmperf's "too few tokens" flags (public runs)
    aiperf = [json.loads(x) for x in (DATA / "aiperf" / "profile_export.jsonl").read_text().splitlines()]
    cancels = [x["error"] for x in aiperf if x["error"]]
    assert cancels and all(error_classes.classify(e["code"], e["type"], e["message"], "error") == "cancelled" for e in cancels)
    flags = [x for x in json.loads((DATA / "llmperf" / "bedrock_70b.json").read_text()) if x["error_code"]]
    assert flags and all(error_classes.classify(x["error_code"], None, x["error_msg"], "error") == "client_flag" for x in flags)
    assert not error_classes.CLASSES["cancelled"].failure and not error_classes.CLASSES["client_flag"].failure


@pytest.mark.parametrize("status,text,expect", [
    # substring matching sent these to "out of KV": words must match whole
    (500, "bloom filter rebuild failed", "server_error"),
    (None, "Rate limit exceeded", "rate_limited"),
    (429, None, "rate_limited"),
    (500, "CUDA out of memory. Tried to allocate 2.00 GiB", "kv_exhausted"),
    (400, "'messages' must be a list", "invalid_request"),
    (503, None, "overloaded"),
    (504, None, "timeout"),
    (499, None, "cancelled"),
])
def test_word_bounded_classes(status, text, expect):
    assert error_classes.classify(status, None, text, "error") == expect


def test_llmperf_flags_are_not_an_error_burst(tmp_path, run_cli):
    """bedrock_70b: 49 of 150 requests carry llmperf's -100 "Output too few tokens" (the model
    stopped early). They completed: no error incident, and no --max-model-len advice."""
    out = tmp_path / "cap"
    assert run_cli("import", "llmperf", DATA / "llmperf" / "bedrock_70b.json", "-o", out).returncode == 0
    diag = diagnose(kvdoctor.load(out))
    assert not any(i.symptom in ("errors", "memory") for i in diag.incidents)
    w = diag.prepared.window(diag.start_s, diag.end_s)
    assert w.value("errors") == 0 and w.value("client_flagged_requests") == 49


@pytest.mark.parametrize("sample", ["context-overflow", "vllm-context-overflow"])
def test_context_overflow_gets_the_context_fix(sample):
    """Real llama-server and vLLM 400s ("exceeds the available context size", "maximum context
    length"): one incident, about the context a request may use, with its fix. A refusal is
    not KV memory (the server refuses before it allocates any): no out-of-memory incident."""
    diag = diagnose(kvdoctor.load(ROOT / "samples" / sample))
    by_symptom = {i.symptom: i.causes[0] for i in diag.incidents if not i.observation}
    top = by_symptom["errors"]
    assert top.rule.id == "error-burst" and "context" in top.cause.lower()
    assert top.fixes[0].title.startswith("Keep prompt + max_tokens within the context")
    assert "memory" not in by_symptom and not any(c.rule.id == "kv-oom" for i in diag.incidents for c in i.causes)
    if sample == "context-overflow":
        assert "raise -c or lower --parallel" in top.fixes[0].knobs["llamacpp"]


# --------------------------------------------------------------------------- real gateway 429s

@pytest.mark.server
def test_real_gateway_rate_limit_is_not_blamed_on_the_server(tmp_path):
    """A real nginx with a request-rate limit (429) in front of a real llama-server, kvdoctor
    attached in front of the gateway (harness/gateway.py, which also records
    samples/gateway-rate-limit): the 429s are rate limits with a quota fix, never out-of-KV."""
    from harness.gateway import record

    cap = tmp_path / "cap"
    timings = record(cap)
    if timings is None:
        pytest.skip("nginx absent (scripts/install-services installs nginx-light)")
    refused = sum(t.http_status == 429 for t in timings)
    assert refused >= 10 and sum(t.status == "ok" for t in timings) >= 3
    c = kvdoctor.load(cap)
    diag = diagnose(c)
    prep = diag.prepared
    http = c.requests.num("http_status")[prep._order]
    # per request: every 429 the client saw is recorded and classed as a rate limit
    assert int(np.sum(http == 429)) == refused
    assert set(prep.error_class[http == 429]) == {"rate_limited"}
    errors = [i for i in diag.incidents if i.symptom == "errors"]
    assert errors, [i.symptom for i in diag.incidents]
    top = errors[0].causes[0]
    assert top.rule.id == "error-burst" and top.cause.startswith("Rate-limited")
    assert "quota" in top.fixes[0].title and "--max-model-len" not in json.dumps([f.knobs for f in top.fixes])
    assert not any(i.symptom == "memory" for i in diag.incidents)  # not out of KV
