"""A recorder starved of CPU (the proxy sharing two cores with a busy engine) reads a stream's
chunks in one burst: they are stamped together, so the stream's TPOT and inter-token gaps are
~0 and measure the reader, not the engine. kvdoctor leaves those out as not measured and says so.

Built on a real llama-server capture (samples/multi-turn): a third of its streams are re-stamped
as a starved reader would have stamped them (every chunk at the stream's finish), the rest kept.
"""
import dataclasses

import numpy as np
import pytest

import kvdoctor
from kvdoctor.capture.memory import from_records
from kvdoctor.diagnosis import diagnose
from kvdoctor.model import RequestRecord, derive_request
from kvdoctor.signals import Prepared
from kvdoctor.signals.prepared import READ_BURST_S

from conftest import ROOT, request_records

SAMPLES = ROOT / "samples"


def _read_in_one_burst(r: RequestRecord) -> RequestRecord:
    """The stream as a reader that got a core only at its end would stamp it (TTFT kept: the
    first chunk may well have been read on time; it is the decode timing that collapses)."""
    n = len(r.itl_s)
    return derive_request(dataclasses.replace(
        r, itl_s=[0.0001] * n, itl_p50_s=None, itl_p99_s=None, itl_max_s=None, tpot_s=None,
        finish_s=r.first_token_s + 0.0001 * n, e2e_s=None))


@pytest.fixture(scope="module")
def starved():
    cap = kvdoctor.load(SAMPLES / "multi-turn")
    recs = request_records(cap)
    late = {r.request_id for i, r in enumerate(recs) if i % 3 == 0 and r.itl_s and len(r.itl_s) >= 3}
    recs = [_read_in_one_burst(r) if r.request_id in late else r for r in recs]
    return cap, from_records(cap.meta, requests=recs), late


def test_burst_read_streams_are_not_measured(starved):
    cap, burst, late = starved
    prep = Prepared(burst)
    ids = np.array(burst.requests.strings("request_id"), dtype=object)
    order = np.argsort(burst.requests.num("arrival_s"), kind="stable")
    marked = set(ids[order][prep.read_late])
    assert marked == late
    assert np.isnan(prep.col["tpot_s"][prep.read_late]).all()
    assert np.isfinite(prep.col["tpot_s"][~prep.read_late]).sum() >= len(ids) - len(late) - 2
    # the original capture has no such stream (a real reader on an idle machine)
    assert not Prepared(cap).read_late.any()


def test_diagnosis_is_the_unstarved_one_and_says_what_it_left_out(starved):
    cap, burst, late = starved
    before, after = diagnose(cap), diagnose(burst)
    top = lambda d: [i.causes[0].rule.id for i in d.incidents]  # noqa: E731
    assert top(after) == top(before) == ["kv-growth-per-turn"]
    # TPOT's tail is the engine's: the ~0 TPOT of the burst streams does not drag the median
    tp = lambda d: d.to_json()["incidents"][0]["causes"][0]["evidence"]["tpot_growth_per_turn_frac"]["value"]  # noqa: E731
    assert tp(after) == pytest.approx(tp(before), rel=0.5)
    note = [w for w in after.warnings if "read in bursts" in w]
    assert note and note[0].startswith(f"{len(late)} of {len(cap.requests)} streams"), after.warnings
    assert f"{READ_BURST_S * 1e3:g} ms" in note[0]
    assert not [w for w in before.warnings if "read in bursts" in w]
