"""Every symptom reproduced on a real llama-server, with kvdoctor attached through its proxy:
the expected rule must be the top cause of an incident, its evidence must agree with what the
client measured, `healthy` must stay quiet, and no scenario may raise an unrelated incident."""
import dataclasses
import json

import numpy as np
import pytest

import kvdoctor
from conftest import cause_tops, causes_fired, pages
from kvdoctor.diagnosis import diagnose

pytestmark = [pytest.mark.server, pytest.mark.slow]

#: rules that may accompany the expected one because they describe the same mechanism
RELATED = {
    # long prefills share the 2 CPU cores with the running decodes, so TPOT rises with concurrency
    # too: decode-stall-tail names it (prefills interleaved with decode steps); decode-bandwidth-bound
    # may still fire as its low-confidence CPU hypothesis
    # ... and per decode gap the stalls follow the long prompts' tokens (prefill-decode-interference),
    # which a long-prompt minority makes a tiering case (issue 17)
    "prefill-bound": {"prefill-bound", "long-prompt-hol-blocking", "queueing-saturation", "prompt-length-tail", "tail-latency",
                      "decode-stall-tail", "decode-bandwidth-bound", "prefill-decode-interference", "mixed-length-tiering"},
    "kv-growth-per-turn": {"kv-growth-per-turn", "prefill-bound", "decode-bandwidth-bound", "queueing-saturation"},
    "decode-bandwidth-bound": {"decode-bandwidth-bound", "queueing-saturation", "tail-latency"},
    # long sequences x concurrency: the decodes that do run share the machine, so TPOT rises too
    "error-burst": {"error-burst", "unsafe-concurrency", "prompt-length-tail", "queueing-saturation",
                    "long-prompt-hol-blocking", "prefill-bound", "decode-bandwidth-bound", "decode-stall-tail",
                    "prefill-decode-interference"},
    "prefix-cache-ineffective": {"prefix-cache-ineffective", "prefill-bound"},
    # recorded in samples/ (3.4 and 10 min on 2 cores: too long for this list); the long prefills
    # also make TTFT prefill-bound and, with a smaller batch, queue
    "prefill-decode-interference": {"prefill-decode-interference", "prefill-bound", "long-prompt-hol-blocking",
                                    "queueing-saturation", "prompt-length-tail", "tail-latency", "decode-stall-tail",
                                    "decode-bandwidth-bound", "mixed-length-tiering"},
    None: set(),
}


#: rules that name the same root cause as the expected one: long prefills holding the slots lead
#: as prefill-bound on an idle host and as long-prompt-hol-blocking on a busy one (slower prefills,
#: so more short requests arrive behind each and TTFT follows the queue more than the own prompt)
SAME_ROOT = {"prefill-bound": {"long-prompt-hol-blocking"}}


@pytest.fixture(scope="module")
def scenario_run(tmp_path_factory):
    from harness import scenarios

    results = {}

    def run(name):
        if name not in results:
            out = tmp_path_factory.mktemp("scenarios") / name
            timings = scenarios.run(scenarios.SCENARIOS[name], out)
            results[name] = (out, timings)
        return results[name]

    return run


def _client(timings, attr):
    return np.array([getattr(t, attr) for t in timings if t.status == "ok" and getattr(t, attr) is not None])


@pytest.mark.parametrize("name", ["healthy", "long-prompts", "multi-turn", "concurrency", "context-overflow",
                                  "prefix-cache-off", "prefix-cache-on", "one-conversation-at-a-time",
                                  "mixed-prompts-2-slots"])
def test_scenario_names_its_cause(scenario_run, name):
    from harness.scenarios import SCENARIOS

    out, timings = scenario_run(name)
    expect = SCENARIOS[name].expect
    diag = diagnose(kvdoctor.load(out))
    fired = causes_fired(diag)  # causes; objective-* rules say an objective broke, not why
    report = json.dumps(diag.to_json()["incidents"], indent=1)[:3000]
    # the host these tests share (2 cores: pytest, the sidecar, the load generator, other jobs)
    # can stall decode steps; kvdoctor names that when it measured the host busy with other
    # processes, and that incident is about the machine, not the scenario's workload
    host = [inc for inc in diag.incidents if _blames_the_host(inc)]
    fired -= {c.rule.id for inc in host for c in inc.causes} - {c.rule.id for inc in diag.incidents
                                                                 if inc not in host for c in inc.causes}
    tops = cause_tops(dataclasses.replace(diag, incidents=[i for i in diag.incidents if i not in host]))
    if expect is None:
        from harm_checks import skip_unless_client_met_objectives

        skip_unless_client_met_objectives(timings)
        # a healthy run pages nobody (observations, info, may be said)
        assert all(inc in host for inc in pages(diag)), f"{name} should raise no incident:\n{report}"
    else:
        assert expect in tops or set(tops) & SAME_ROOT.get(expect, set()), \
            f"{name}: expected {expect} as a top cause, got {tops}:\n{report}"
        unrelated = fired - RELATED[expect]
        assert not unrelated, f"{name}: unrelated rules fired {unrelated}:\n{report}"

    # the capture's latencies are the client's, seen from the proxy: same requests, same numbers.
    # Paired per request by the client's X-Request-Id, never by percentiles of a distribution
    # (clustered TTFTs put two medians on either side of a gap although every request agrees).
    cap = kvdoctor.load(out)
    d_ttft = paired_differences(cap, timings, "ttft_s")
    assert len(d_ttft) == len(_client(timings, "ttft_s")), "every successful client request is in the capture"
    # the proxy sees the first chunk one loopback hop before the client does
    assert np.median(np.abs(d_ttft)) < 0.010, d_ttft
    # most within a few ms; a busy 2-core machine can hold one thread for a scheduler slice
    assert np.percentile(np.abs(d_ttft), 90) < 0.030, d_ttft


def _blames_the_host(inc) -> bool:
    """An incident whose leading cause is the host, measured: the engine's threads waiting for a core
    (host-cpu-contention), or a decode stall beside other processes' measured CPU."""
    top = inc.causes[0]
    return top.rule.id == "host-cpu-contention" or (
        top.rule.id == "decode-stall-tail" and top.evidence.get("host_other_cpu_frac", 0) >= 0.25 and "host" in top.cause)


def paired_differences(cap, timings, attr: str) -> np.ndarray:
    """capture minus client, for each successful request both saw (joined by request id)."""
    ids = cap.requests.strings("request_id")
    vals = cap.requests.num(attr)
    status = cap.requests.strings("status")
    mine = {i: v for i, v, s in zip(ids, vals, status) if s == "ok" and not np.isnan(v)}
    pairs = [(mine[t.request_id], getattr(t, attr)) for t in timings
             if t.status == "ok" and getattr(t, attr) is not None and t.request_id in mine]
    return np.array([a - b for a, b in pairs])


def test_multi_turn_evidence_matches_client(scenario_run):
    from kvdoctor.signals import Prepared
    from kvdoctor.signals.host import contended

    out, timings = scenario_run("multi-turn")
    cap = kvdoctor.load(out)
    diag = diagnose(cap)
    inc, cause = next((i, c) for i in diag.incidents for c in i.causes if c.rule.id == "kv-growth-per-turn")
    # the requests the evidence reads: those that arrived in the incident's span, less the ones
    # kvdoctor leaves out of a trend by design: ran while other processes held the host (the
    # sidecar's host samples, signals/host.py; this 2-core machine's first turns often do) or
    # were read in bursts by a starved proxy (Prepared.read_late)
    p = Prepared(cap)
    w = p.window(inc.start_s, inc.end_s)
    ids = p.request_ids[w.req]
    used = set(ids[~(contended(w) | p.read_late[w.req])])
    # ground truth over those requests: the client's per-token decode time per turn rises (each
    # request's median gap between the chunks the client received), fitted over the turns with
    # three requests, as kvdoctor fits per-turn medians (signals/sessions.py)
    mine = [t for t in timings if t.request_id in used and len(t.chunk_times_s) >= 3]
    turns = sorted(k for k in {t.turn for t in mine} if sum(t.turn == k for t in mine) >= 3)
    assert len(turns) >= 4, f"a trend needs 4 turns; {len(used)} of {len(timings)} requests read"
    med = [np.median([np.median(np.diff(t.chunk_times_s)) for t in mine if t.turn == k]) for k in turns]
    client_growth = np.polyfit(turns, med, 1)[0] / med[0]
    assert cause.evidence["tpot_growth_per_turn_frac"] == pytest.approx(client_growth, rel=0.35, abs=0.01)
    assert cause.evidence["turn_max"] == 10


def test_prefix_cache_off_vs_on(scenario_run):
    off, _ = scenario_run("prefix-cache-off")
    on, _ = scenario_run("prefix-cache-on")
    d_off = diagnose(kvdoctor.load(off)).to_json()
    cause = next(c for inc in d_off["incidents"] for c in inc["causes"] if c["rule"] == "prefix-cache-ineffective")
    assert cause["evidence"]["prefix_hit_rate_achievable"]["value"] > 0.8
    assert cause["evidence"]["prefix_hit_rate_achieved"]["value"] < 0.1
    from kvdoctor.signals import Prepared

    p = Prepared(kvdoctor.load(on))
    assert p.window(p.start_s, p.end_s).value("prefix_hit_rate_achieved") > 0.7


def test_context_overflow_errors_match_client(scenario_run):
    out, timings = scenario_run("context-overflow")
    client_errors = sum(1 for t in timings if t.status != "ok")
    cap = kvdoctor.load(out)
    assert client_errors > 0
    assert sum(1 for s in cap.requests.strings("status") if s != "ok") == client_errors


def test_kv_quant_rule_agrees_with_the_quality_check(tmp_path):
    """q4_0 K/V against an f16 baseline, greedy: the rule fires exactly when `kvdoctor quality`
    finds long-context degradation, and its evidence is the baseline comparison."""
    from harness.scenarios import run_quality
    from kvdoctor.quality import by_context, verdict

    out = tmp_path / "kv-quant"
    results = run_quality("kv-quant", out)
    degraded = verdict(by_context(results), results=results).startswith("DEGRADED")
    diag = diagnose(kvdoctor.load(out))
    fired = [c for inc in diag.incidents for c in inc.causes if c.rule.id == "kv-quant-quality"]
    assert bool(fired) == degraded
    from kvdoctor.signals import Prepared

    p = Prepared(kvdoctor.load(out))
    w = p.window(p.start_s, p.end_s)
    assert w.value("baseline_compared") == 1 and w.value("kv_dtype_quantised") == 1
    assert 0 <= w.value("baseline_agreement_long_p50") <= 1
    assert w.value("baseline_forced_compared") == 1  # llama.cpp gives the teacher-forced measure
    assert p.meta.engine == "llamacpp"  # asked of the candidate: the fixes name llama.cpp's knobs first
    assert all(0 < r.forced_positions <= 48 for r in results)


def test_teacher_forced_agreement_of_identical_servers_is_whole(run_cli, tmp_path):
    """The measure's floor, by construction, through `kvdoctor quality` as a user runs it: two f16
    servers forced over the same continuation pick the same next token at every position (the two
    sides are computed alike, one step a position on each), and the verdict says no degradation.
    A difference here would be the method's, not the KV format's."""
    from harness.llama_server import LlamaServer
    from harness.scenarios import quality_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in quality_prompts(3, 100, 1200)))
    args = ["-fa", "on", "-ctk", "f16", "-ctv", "f16"]
    with LlamaServer(args, n_ctx=2048) as a, LlamaServer(args, n_ctx=2048) as b:
        r = run_cli("quality", "--baseline", a.url, "--candidate", b.url, "--prompts", prompts, "--max-tokens", 16,
                    "--format", "json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [p["forced_agreement_frac"] for p in got["prompts"]] == [1.0, 1.0, 1.0]
    assert all(0 < p["forced_positions"] <= 16 for p in got["prompts"])  # EOS may end a continuation early
    assert got["verdict"].startswith("no degradation") and "100.0% of positions" in got["verdict"]


def test_one_conversation_at_a_time_names_history_growth(scenario_run):
    """Issue 12 class 9: concurrency 1 (the client's own timings never overlap), so TPOT that
    grows can only be the history: kv-growth-per-turn leads, decode-bandwidth-bound is silent."""
    out, timings = scenario_run("one-conversation-at-a-time")
    ok = sorted((t for t in timings if t.status == "ok"), key=lambda t: t.send_s)
    assert all(b.send_s >= a.finish_s for a, b in zip(ok, ok[1:])), "requests overlapped"
    diag = diagnose(kvdoctor.load(out))
    assert diag.incidents[0].causes[0].rule.id == "kv-growth-per-turn"
    assert "decode-bandwidth-bound" not in {c.rule.id for inc in diag.incidents for c in inc.causes}


def test_mixed_prompts_lead_with_long_prefills(scenario_run):
    """Issue 12 class 9: 3 clients, 2 slots, 10-word and 900-1,400-word prompts: the first cause
    of the first incident is a long-prefill rule, not queueing's 'add replicas'."""
    out, _ = scenario_run("mixed-prompts-2-slots")
    diag = diagnose(kvdoctor.load(out))
    # prefill-decode-interference names the same long prefills, seen in the decodes they stall
    assert diag.incidents[0].causes[0].rule.id in ("long-prompt-hol-blocking", "prefill-bound", "prefill-decode-interference")
