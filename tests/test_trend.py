"""trend_z: the stratified Mann-Kendall test kv-growth-per-turn reads (does a later turn of the same
conversation run slower than an earlier one, beyond chance)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvdoctor.signals.registry import trend_z


def reference_z(stratum, x, y) -> float:
    """The textbook form, one stratum and one pair at a time (Kendall 1970's variance with ties)."""
    s_total = var_total = 0.0
    for k in set(stratum.tolist()):
        xs, ys = x[stratum == k], y[stratum == k]
        n = len(xs)
        for i in range(n):
            for j in range(i + 1, n):
                s_total += np.sign(xs[j] - xs[i]) * np.sign(ys[j] - ys[i])

        def ties(a):
            t = np.array([c for c in np.unique(a, return_counts=True)[1] if c > 1], dtype=float)
            return (t * (t - 1) * (2 * t + 5)).sum(), (t * (t - 1) * (t - 2)).sum(), (t * (t - 1)).sum()

        (a1, a2, a3), (b1, b2, b3), n = ties(xs), ties(ys), float(n)
        if n < 2:
            continue
        var_total += (n * (n - 1) * (2 * n + 5) - a1 - b1) / 18 + a3 * b3 / (2 * n * (n - 1))
        if n > 2:
            var_total += a2 * b2 / (9 * n * (n - 1) * (n - 2))
    return (s_total - np.sign(s_total)) / np.sqrt(var_total) if var_total > 1e-9 else float("nan")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 4), st.integers(0, 6), st.integers(0, 5)), min_size=0, max_size=40))
def test_equals_the_pairwise_definition(rows):
    """Ties in turn and in value, strata of one request, the unknown stratum (-1): as by hand."""
    a = np.array(rows, dtype=float).reshape(-1, 3)
    stratum, x, y = a[:, 0].astype(np.int64), a[:, 1], a[:, 2]
    got, want = trend_z(stratum, x, y), reference_z(stratum, x, y)
    assert (np.isnan(got) and np.isnan(want)) or got == pytest.approx(want, abs=1e-9)


def test_unrelated_values_pass_3_about_once_in_a_thousand():
    """The threshold's meaning: 6 conversations x 8 turns of noise, 4,000 times."""
    rng = np.random.default_rng(7)
    stratum, turn = np.repeat(np.arange(6), 8), np.tile(np.arange(8.0), 6)
    z = np.array([trend_z(stratum, turn, rng.normal(size=48)) for _ in range(4000)])
    assert 0.9 < z.std() < 1.1 and abs(z.mean()) < 0.05
    assert (z >= 3).mean() < 0.004 and (z >= 2).mean() > 0.01


def test_compares_each_conversation_only_with_itself():
    """Conversations that differ in level (longer system prompt, a busier minute) are no trend: a
    pooled correlation over turns calls it one, the stratified test does not."""
    rng = np.random.default_rng(3)
    turn = np.tile(np.arange(8.0), 10)
    stratum = np.repeat(np.arange(10), 8)
    level = np.repeat(rng.permutation(10).astype(float), 8)
    late = turn >= 4  # the slow conversations ran only their later turns in this window
    y = level + rng.normal(scale=0.1, size=80)
    keep = (level >= 5) == late
    assert abs(trend_z(stratum[keep], turn[keep], y[keep])) < 2
    assert abs(trend_z(np.zeros(keep.sum(), dtype=np.int64), turn[keep], y[keep])) > 3


def test_a_small_steady_growth_under_noise_is_found():
    """+3% a turn under 10% noise per request (a decode step beside other requests' prefills): the
    per-turn medians of 6 conversations wobble, every request together does not."""
    rng = np.random.default_rng(11)
    stratum, turn = np.repeat(np.arange(6), 8), np.tile(np.arange(8.0), 6)
    zs = [trend_z(stratum, turn, 0.1 * (1 + 0.03 * turn) * (1 + rng.normal(scale=0.1, size=48)))
          for _ in range(200)]
    assert np.median(zs) > 3


def test_one_huge_stratum_is_subsampled_not_quadratic():
    """Requests without a conversation id share one stratum: past max_per_stratum it is evenly
    subsampled, and a clean trend stays clear."""
    x = np.arange(50_000, dtype=float)
    z = trend_z(np.full(len(x), -1), x, x + np.sin(x), max_per_stratum=500)
    assert z > 20


def test_needs_two_distinct_turns_in_some_conversation():
    assert np.isnan(trend_z(np.arange(5), np.arange(5.0), np.arange(5.0)))  # every request its own conversation
    assert np.isnan(trend_z(np.zeros(5, dtype=np.int64), np.ones(5), np.arange(5.0)))


def test_past_max_points_whole_conversations_are_kept_evenly():
    """1,000 conversations x 8 turns with max_points 800: every 10th conversation, all its pairs
    (exactly the test over those conversations), so the cost is bounded and z keeps its meaning."""
    rng = np.random.default_rng(5)
    stratum, turn = np.repeat(np.arange(1000) * 3 + 7, 8), np.tile(np.arange(8.0), 1000)
    y = 1 + 0.02 * turn + rng.normal(scale=0.1, size=len(turn))
    kept = np.isin(stratum, np.unique(stratum)[::10])
    assert trend_z(stratum, turn, y, max_points=800) == pytest.approx(reference_z(stratum[kept], turn[kept], y[kept]))
    assert trend_z(stratum, turn, y) > trend_z(stratum, turn, y, max_points=800) > 3


@pytest.mark.parametrize("sample", ["vllm-multi-turn", "multi-turn", "one-conversation-at-a-time"])
def test_conversations_inferred_from_prefix_chains(sample):
    """Most clients send no session id. The real multi-turn captures with their session ids and
    turns removed: every request's conversation and turn come back from the prompt block hashes
    alone (each turn's prompt extends the previous one), and kv-growth-per-turn still fires."""
    import dataclasses

    import kvdoctor
    from kvdoctor.capture.memory import from_records
    from kvdoctor.diagnosis import diagnose

    from conftest import ROOT, request_records

    cap = kvdoctor.load(ROOT / "samples" / sample)
    recs = request_records(cap)
    truth = {r.request_id: (r.session_id, r.turn) for r in recs}
    diag = diagnose(from_records(cap.meta, requests=[dataclasses.replace(r, session_id=None, turn=None) for r in recs]))
    prep = diag.prepared
    turns, sessions = prep.column("turn"), prep.session
    assert prep.turns_inferred
    for k, rid in enumerate(prep.request_ids):
        assert turns[k] == truth[rid][1], (rid, turns[k], truth[rid])
    # one inferred conversation per real one, never two real ones merged
    pairs = {(sessions[k], truth[rid][0]) for k, rid in enumerate(prep.request_ids)}
    assert len({s for s, _ in pairs}) == len({t for _, t in pairs}) == len(pairs)
    assert any(c.rule.id == "kv-growth-per-turn" for i in diag.incidents for c in i.causes)


def test_a_shared_system_prompt_is_not_a_conversation():
    """samples/prefix-cache-off: 24 requests share a 1,200-token system prompt, each its own
    question: no request extends another, so none is given a conversation."""
    import kvdoctor
    from kvdoctor.diagnosis import diagnose

    from conftest import ROOT

    cap = kvdoctor.load(ROOT / "samples" / "prefix-cache-off")
    import dataclasses

    from kvdoctor.capture.memory import from_records

    from conftest import request_records

    recs = [dataclasses.replace(r, session_id=None, turn=None) for r in request_records(cap)]
    prep = diagnose(from_records(cap.meta, requests=recs)).prepared
    assert (prep.session < 0).all() and not prep.turns_inferred
