"""Windows judged by forked workers (a large capture on the CLI) give the diagnosis judging them
here gives: the same incidents, causes, evidence and "not evaluated" list, in the same order."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvdoctor
from kvdoctor.diagnosis import Options, diagnose
from kvdoctor.diagnosis import evaluate as E

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def _same_diagnosis(name: str, monkeypatch, **opt) -> tuple[dict, dict, int]:
    cap = kvdoctor.load(SAMPLES / name)
    here = diagnose(cap, options=Options(workers=1, **opt)).to_json()
    monkeypatch.setattr(E, "PARALLEL_MIN_REQUESTS", 1)
    forks = []
    real = E._workers
    monkeypatch.setattr(E, "_workers", lambda *a: forks.append(real(*a)) or forks[-1])
    seen = []
    there = diagnose(kvdoctor.load(SAMPLES / name), options=Options(workers=2, **opt),
                     progress=lambda k, n: seen.append((k, n))).to_json()
    assert forks == [2], "the windows were shared among two forked workers"
    assert seen[-1][0] == seen[-1][1] and [k for k, _ in seen] == sorted(k for k, _ in seen)
    return here, there, seen[-1][1]


@pytest.mark.parametrize("name", ["aibrix-qps-4.1", "busy-host", "prefill-interference"])
def test_forked_windows_give_the_same_diagnosis(name, monkeypatch):
    here, there, n_windows = _same_diagnosis(name, monkeypatch, step_s=10.0, lookback_s=60.0)
    assert n_windows >= 4
    assert json.dumps(there, sort_keys=True, default=str) == json.dumps(here, sort_keys=True, default=str)


def test_small_captures_and_the_library_default_judge_here(monkeypatch):
    cap = kvdoctor.load(SAMPLES / "aibrix-qps-4.1")
    prep = diagnose(cap).prepared
    assert E._workers(prep, 50, Options()) == 1  # the library's default: no fork in a caller's process
    assert E._workers(prep, 50, Options(workers=0)) == 1  # under PARALLEL_MIN_REQUESTS
    monkeypatch.setattr(E, "PARALLEL_MIN_REQUESTS", 1)
    assert E._workers(prep, 3, Options(workers=0)) == 1  # too few windows to share
    assert 1 <= E._workers(prep, 50, Options(workers=0)) <= E.MAX_WORKERS
