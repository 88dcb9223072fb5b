"""Checks shared by the real-server harm tests on llama.cpp (tests/test_harm_real.py) and vLLM
(tests/test_vllm.py): the ground truth is the load the test itself sent (its phases and the
client's own timings), never kvdoctor's output."""
from __future__ import annotations

import json

import kvdoctor
from conftest import cause_tops, pages
from kvdoctor.diagnosis import Options, diagnose
from kvdoctor.objectives import parse_slo


def check_healthy_mixed(out, timings) -> None:
    """No warning or critical; a shape rule may be said as an observation. And the same capture
    against a stated objective below what it did must page, with that objective first."""
    ok = [t for t in timings if t.status == "ok"]
    assert len(ok) == len(timings), "every request of the light load succeeds"
    diag = diagnose(kvdoctor.load(out))
    report = json.dumps(diag.to_json()["incidents"], indent=1)[:3000]
    assert not pages(diag), f"a healthy server at light load must page nobody:\n{report}"
    ttft = sorted(t.ttft_s for t in ok)
    target = ttft[len(ttft) // 2]  # the median: half the requests break it
    strict = diagnose(kvdoctor.load(out), options=Options(slo=parse_slo([f"ttft_p99={target * 1000:.0f}ms"])))
    first = pages(strict)[0]
    assert first.symptom == "ttft" and first.breaches and first.breaches[0].objective.stated, strict.to_json()
    assert first.severity == "critical"  # half over a P99's 1% budget: a burn rate of ~50


def check_ramp(out, timings, agent, n_first: int, hold_s: float) -> None:
    """The incident starts where the second phase began (the queue forms as its twelve users
    arrive), within one hold (queueing-saturation's 30 s) after it and not before it, offline and
    in the live sidecar's own incident."""
    queue_formed = min(t.send_s for t in timings[n_first:])
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
