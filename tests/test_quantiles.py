"""kvdoctor.signals.quantiles: numpy's median and linear percentile to the last bit, by partitions."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvdoctor
from kvdoctor.signals.prepared import Prepared
from kvdoctor.signals.quantiles import Ranked, median, percentiles

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
QS = (0, 1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9, 100)


def _arrays(seed: int = 0, n: int = 400):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        size = int(rng.integers(1, 80))
        kind = rng.integers(3)
        if kind == 0:  # many ties (token counts)
            yield rng.integers(0, 6, size).astype(float)
        elif kind == 1:
            yield rng.lognormal(0, 1, size)
        else:  # sorted and reversed inputs: partition's worst orders
            a = np.sort(rng.normal(0, 1, size))
            yield a[::-1].copy() if rng.integers(2) else a


@pytest.mark.parametrize("seed", [0, 1])
def test_ranked_percentiles_are_numpys_bit_for_bit_in_any_order(seed):
    rng = np.random.default_rng(100 + seed)
    for a in _arrays(seed):
        r = Ranked(a.copy())
        for q in rng.choice(QS, size=6):  # repeats and any order: each query reuses the ranks placed
            assert r.percentile(float(q)) == float(np.percentile(a, q)), (a, q)
        assert sorted(r.values.tolist()) == sorted(a.tolist())  # reordered, nothing lost
        assert r.placed == sorted(set(r.placed))
        for k in r.placed:  # each placed rank splits the values
            assert (r.values[:k] <= r.values[k]).all() and (r.values[k + 1:] >= r.values[k]).all()


def test_ranked_order_statistics_and_empty():
    a = np.array([5.0, 1.0, 4.0, 1.0, 3.0])
    r = Ranked(a.copy())
    assert [r.at(k) for k in (4, 0, 2, 1, 3)] == [5.0, 1.0, 3.0, 1.0, 4.0]
    assert np.isnan(Ranked(np.array([])).percentile(50))


def test_median_and_percentiles_match_numpy():
    for a in _arrays(7, 200):
        assert median(a.copy()) == float(np.median(a))
        assert percentiles(a.copy(), (50, 90, 99)) == [float(np.percentile(a, q)) for q in (50, 90, 99)]


def test_window_pct_is_numpys_percentile_of_the_known_values():
    """On a real capture: every request column's percentiles in a window, NaN (unknown) left out."""
    prep = Prepared(kvdoctor.load(SAMPLES / "vllm-multi-turn"))
    w = prep.window(prep.start_s, prep.end_s)
    checked = 0
    for col in ("ttft_s", "tpot_s", "e2e_s", "prompt_tokens", "context_tokens"):
        a = w.r(col)
        known = a[~np.isnan(a)]
        if not len(known):
            continue
        for q in (99, 50, 90, 99):
            assert w.pct(col, q) == float(np.percentile(known, q))
        checked += 1
    assert checked >= 4
    assert np.isnan(w.pct("ttft_s", 50, min_n=10**9))  # fewer known values than asked: unknown
