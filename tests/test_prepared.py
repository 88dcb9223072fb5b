"""kvdoctor.signals.prepared: the per-capture columns the signals share."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvdoctor
from kvdoctor.signals.prepared import Prepared

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


@pytest.mark.parametrize("sample", ["aibrix-qps-4.1", "vllm-preemption", "parallel-8"])
def test_decode_concurrency_is_the_mean_in_flight_over_each_decode(sample):
    """The per-request form computed once per capture (lookups in finish order) equals the general
    mean_in_flight over each request's (first token, finish)."""
    prep = Prepared(kvdoctor.load(SAMPLES / sample))
    want = prep.mean_in_flight(prep.col["first_token_s"], prep.col["finish_s"])
    got = prep.col["decode_concurrency"]
    assert np.isfinite(got).sum() >= 10
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, equal_nan=True)


def test_concurrency_at_arrival_counts_the_requests_in_flight():
    """Requests in flight when each arrived (itself included), against a direct count."""
    prep = Prepared(kvdoctor.load(SAMPLES / "aibrix-qps-4.1"))
    arr, fin = prep.t, prep.col["finish_s"]
    want = np.array([np.sum((arr <= a) & ~(fin <= a)) for a in arr], dtype=float)
    np.testing.assert_array_equal(prep.col["concurrency"], want)
