"""Checks shared by the real-server harm tests on llama.cpp (tests/test_harm_real.py) and vLLM
(tests/test_vllm.py): the ground truth is the load the test itself sent (its phases and the
client's own timings), never kvdoctor's output."""
from __future__ import annotations

import json

import kvdoctor
from conftest import cause_tops, pages
from kvdoctor.diagnosis import Options, diagnose
from kvdoctor.objectives import parse_slo


def skip_unless_client_met_objectives(timings, tpot_s: float = 0.1) -> None:
    """The premise of a healthy run, from the client's own timings: the light load met the default
    objectives (TTFT P99 2 s, TPOT P99 100 ms). A host busy with other work can break them for
    real, and then paging is right: the test skips, saying what the client saw. Read as the
    objective reads: more requests over the target than a P99 lets be over (one at least)."""
    import numpy as np
    import pytest

    ok = [t for t in timings if t.status == "ok" and t.ttft_s is not None]
    ttft = np.array([t.ttft_s for t in ok])
    tpot = np.array([(t.chunk_times_s[-1] - t.chunk_times_s[0]) / (len(t.chunk_times_s) - 1)
                     for t in ok if len(t.chunk_times_s) > 2])
    ttft99 = float(np.percentile(ttft, 99)) if len(ttft) else 0.0
    tpot99 = float(np.percentile(tpot, 99)) if len(tpot) else 0.0
    # a P99 lets 1% of requests be over; one slow request (a cold first prefill) is not a broken P99
    def broken(v, target):
        return int((v > target).sum()) > max(1, 0.01 * len(v))

    if broken(ttft, 2.0) or broken(tpot, tpot_s):
        pytest.skip(f"the host was too busy for a light load to be healthy: the client saw TTFT P99 {ttft99:.2f} s, "
                    f"TPOT P99 {tpot99 * 1e3:.0f} ms (objectives 2 s, {tpot_s * 1e3:.0f} ms); kvdoctor paging is then right")


def check_healthy_mixed(out, timings, tpot_slo_s: float | None = None) -> None:
    """No warning or critical; a shape rule may be said as an observation. And the same capture
    against a stated objective below what it did must page, with that objective first.
    ``tpot_slo_s``: the deployment's stated TPOT P99 objective (--slo), where the hardware cannot
    meet the chat default's 100 ms even for one user (vLLM in float32 on an AVX2-only CPU decodes
    one stream at 65-90 ms a token): a light load is healthy against what its operator states."""

    ok = [t for t in timings if t.status == "ok"]
    assert len(ok) == len(timings), "every request of the light load succeeds"
    skip_unless_client_met_objectives(timings, tpot_slo_s or 0.1)
    stated = [f"tpot_p99={tpot_slo_s * 1000:.0f}ms"] if tpot_slo_s else []
    diag = diagnose(kvdoctor.load(out), options=Options(slo=parse_slo(stated)) if stated else None)
    report = json.dumps(diag.to_json()["incidents"], indent=1)[:3000]
    assert not pages(diag), f"a healthy server at light load must page nobody:\n{report}"
    ttft = sorted(t.ttft_s for t in ok)
    target = ttft[len(ttft) // 2]  # the median: half the requests break it
    strict = diagnose(kvdoctor.load(out), options=Options(slo=parse_slo([*stated, f"ttft_p99={target * 1000:.0f}ms"])))
    first = pages(strict)[0]
    assert first.symptom == "ttft" and first.breaches and first.breaches[0].objective.stated, strict.to_json()
    assert first.severity == "critical"  # half over a P99's 1% budget: a burn rate of ~50


def check_ramp(out, timings, agent, n_first: int, hold_s: float) -> None:
    """The incident starts where the second phase began (the queue forms as its twelve users
    arrive), within one hold (queueing-saturation's 30 s) after it and not before it, offline and
    in the live sidecar's own incident."""
    import numpy as np
    import pytest

    queue_formed = min(t.send_s for t in timings[n_first:])
    first = [t for t in timings[:n_first] if t.status == "ok"]
    ttft99 = float(np.percentile([t.ttft_s for t in first], 99)) if first else float("inf")
    tpot = [(t.chunk_times_s[-1] - t.chunk_times_s[0]) / (len(t.chunk_times_s) - 1) for t in first if len(t.chunk_times_s) > 2]
    tpot99 = float(np.percentile(tpot, 99)) if tpot else 0.0
    if ttft99 > 2.0 or tpot99 > 0.1:  # the premise, from the client: one user alone met the objectives
        pytest.skip(f"the host was too busy for the first phase (one user) to be healthy: the client saw TTFT P99 "
                    f"{ttft99:.2f} s, TPOT P99 {tpot99 * 1e3:.0f} ms (objectives 2 s, 100 ms): no onset to find")
    diag = diagnose(kvdoctor.load(out))
    report = json.dumps(diag.to_json()["incidents"], indent=1)[:3000]
    inc = next((i for i in pages(diag) if i.symptom == "ttft"), None)
    assert inc is not None, f"the overloaded phase must page:\n{report}"
    assert "queueing-saturation" in cause_tops(diag) or inc.top.rule.id == "objective-ttft", report
    first_send = min(t.send_s for t in timings)
    assert queue_formed - first_send > 30, "the first phase is long enough to tell an onset from the capture's start"
    assert queue_formed - 5 <= inc.start_s <= queue_formed + hold_s, (inc.start_s - queue_formed, report)
    live = [i for i in agent.live.incidents if i.symptom == "ttft" and not i.observation]
    assert live, f"the live sidecar opened no TTFT incident: {[(i.symptom, i.severity) for i in agent.live.incidents]}"
    assert queue_formed - 5 <= live[0].start_s <= queue_formed + hold_s, live[0].start_s - queue_formed
