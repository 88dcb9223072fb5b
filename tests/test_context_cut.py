"""output-cut-at-context: answers the server stopped at the per-request context limit, read from
token counts and checked against what the load generator itself saw (its finish_reason), a
measurement the rule does not use."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvdoctor
from kvdoctor.diagnosis import diagnose
from kvdoctor.signals import Prepared

ROOT = Path(__file__).resolve().parents[1]
CUT = ["fault-context-cut", "vllm-fault-context-cut"]


def _window(sample: str):
    prep = Prepared(kvdoctor.load(ROOT / "samples" / sample))
    return prep.window(prep.start_s, prep.end_s)


@pytest.mark.parametrize("sample", CUT)
def test_cut_answers_are_those_the_client_saw_end_by_length(sample):
    """Every answer the client saw end with finish_reason "length" short of its max_tokens filled
    the context: the signal counts exactly those."""
    rows = [json.loads(line) for line in (ROOT / "samples" / sample / "client-timings.jsonl").read_text().splitlines()
            if line.strip()]
    by_length = sum(r["finish_reason"] == "length" and r["status"] == "ok" for r in rows)
    w = _window(sample)
    assert by_length == len(rows) == 24
    assert w.value("context_cut_requests") == by_length
    assert w.value("context_cut_frac") == 1.0


@pytest.mark.parametrize("sample", ["context-overflow", "vllm-context-overflow", "healthy", "vllm-multi-turn"])
def test_no_answer_at_the_limit_where_prompts_were_refused_or_fit(sample):
    """Refused prompts are errors, not cut answers; answers that ended on their own are not cut.
    The limit is known on each (the rule could fire there)."""
    w = _window(sample)
    assert w.value("context_limit_tokens") > 0
    assert w.value("context_cut_requests") == 0


@pytest.mark.parametrize("sample", CUT)
def test_the_cut_is_its_own_incident_and_the_ttft_breach_keeps_its_cause(sample):
    """standalone: the capacity finding beside the cut explains the TTFT breach, not the cut."""
    d = diagnose(kvdoctor.load(ROOT / "samples" / sample))
    cut = [i for i in d.incidents if any(c.rule.id == "output-cut-at-context" for c in i.causes)]
    assert len(cut) == 1 and cut[0].causes[0].rule.id == "output-cut-at-context"
    assert all(c.rule.kind == "objective" for c in cut[0].causes[1:])  # beside it only the bare error objective
    # the error-rate objective counts the cut answers as failed (status 200 though they were)
    cuts = _window(sample).value("context_cut_requests")
    assert cut[0].breaches and cut[0].breaches[0].reading.over == cuts > 0
    assert cut[0].breaches[0].reading.cut == cuts  # and says they were cut, not refused
    assert cut[0].severity == "critical" and not cut[0].observation
    ttft = [i for i in d.incidents if i.symptom == "ttft"]
    assert ttft and ttft[0].breaches, "the load broke the TTFT objective in these runs"
    assert ttft[0].causes[0].rule.kind == "cause"  # a cause named for it, not the bare objective
