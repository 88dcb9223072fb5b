"""Per-conversation growth: does each turn get slower as the history (and its KV) grows?"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .host import contended
from .quantiles import order_stats
from .registry import fit, signal, trend_z

MIN_PER_TURN = 3


def _turn_medians(w, column: str) -> tuple[np.ndarray, np.ndarray]:
    """Median of `column` per turn number, for turns with enough requests: MIN_PER_TURN, or
    every conversation's when fewer are in the window (one conversation at a time is a
    legitimate workload: each turn then has one request). Latencies of requests that ran while
    other processes held the host are left out (signals/host.py). Once per window and column."""
    key = f"turn_medians:{column}"
    got = w._cache.get(key)
    if got is None:
        got = w._cache[key] = _turn_medians_of(w, column)
    return got


def _turn_medians_of(w, column: str) -> tuple[np.ndarray, np.ndarray]:
    turn, v = w.r("turn"), w.r(column)
    m = np.isfinite(turn) & np.isfinite(v)
    if column != "prompt_tokens":  # a latency: not while other processes held the host
        m &= ~contended(w)
    n_sessions = w.value("sessions")  # 0 when the capture has no conversation ids
    need = int(min(MIN_PER_TURN, n_sessions)) if n_sessions >= 1 else MIN_PER_TURN
    if np.count_nonzero(m) < 2 * need:
        return np.array([]), np.array([])
    return group_medians(_turn_groups(w, m), v[m], need)


def _turn_groups(w, m: np.ndarray) -> Groups:
    """The window's requests under ``m`` grouped by turn; kept for the last mask, which the
    columns of one window usually share (every latency known: the same requests)."""
    hit = w._cache.get("turn_groups")
    if hit is not None and np.array_equal(hit[0], m):
        return hit[1]
    groups = Groups.of(w.r("turn")[m].astype(np.int64))
    w._cache["turn_groups"] = (m, groups)
    return groups


@dataclass(frozen=True)
class Groups:
    """Integer keys grouped by a stable sort (a radix sort when they span under 2**15)."""
    order: np.ndarray  # the sort
    keys: np.ndarray  # each group's key, ascending
    starts: np.ndarray  # where each group starts in sorted order
    counts: np.ndarray

    @classmethod
    def of(cls, key: np.ndarray) -> Groups:
        lo_key = int(key.min())
        small = key - lo_key
        if int(key.max()) - lo_key < 2**15:
            small = small.astype(np.int16)  # numpy sorts 16-bit integers by radix
        order = np.argsort(small, kind="stable")
        k_sorted = key[order]
        starts = np.flatnonzero(np.concatenate(([True], k_sorted[1:] != k_sorted[:-1])))
        return cls(order, k_sorted[starts], starts, np.diff(np.append(starts, len(k_sorted))))


#: group_medians takes one partition per group up to this many groups, else one sort of all values
MAX_GROUPS_PARTITIONED = 256


def group_medians(groups: Groups, v: np.ndarray, min_count: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(each key with at least ``min_count`` values, ascending, as floats; the median of its
    values): each group's middle one or two read by a partition, or, past
    MAX_GROUPS_PARTITIONED groups, by one sort on (key, value)."""
    v_sorted = v[groups.order]
    keep = groups.counts >= min_count
    keys, starts, counts = groups.keys[keep], groups.starts[keep], groups.counts[keep]
    lo, hi = (counts - 1) // 2, counts // 2
    if len(starts) > MAX_GROUPS_PARTITIONED:
        # one float key sorts by key, then value (cheaper than lexsort): each group's middle is its median
        k_sorted = np.repeat(groups.keys, groups.counts)
        vspan = float(v_sorted.max() - v_sorted.min()) or 1.0
        within = np.argsort(k_sorted + 0.999 * (v_sorted - v_sorted.min()) / vspan, kind="stable")
        vs = v_sorted[within]
        meds = (vs[starts + lo] + vs[starts + hi]) / 2.0
    else:
        meds = np.empty(len(starts))
        for g, (s0, c, a, b) in enumerate(zip(starts.tolist(), counts.tolist(), lo.tolist(), hi.tolist())):
            v_a, v_b = order_stats(v_sorted[s0:s0 + c], (a, b)) if b > a else order_stats(v_sorted[s0:s0 + c], (a,)) * 2
            meds[g] = (v_a + v_b) / 2.0
    return keys.astype(float), meds


def _growth_per_turn(w, column: str) -> float:
    """Fitted change per turn of the per-turn median, as a share of the first turn's median."""
    turns, meds = _turn_medians(w, column)
    if len(turns) < 4 or meds[0] <= 0:
        return np.nan
    slope, _, _ = fit(turns, meds, min_n=4)
    return slope / meds[0]


@signal("turn_max", "turns")
def turn_max(w):
    """Deepest conversation turn seen."""
    t = w.r("turn")
    return float(np.nanmax(t)) if np.isfinite(t).any() else np.nan


@signal("ttft_growth_per_turn_frac", "fraction/turn")
def ttft_growth(w):
    """TTFT added per turn, as a share of turn 1's median TTFT."""
    return _growth_per_turn(w, "ttft_s")


def _decode_step(w) -> str:
    """The per-token decode time a longer history slows: each request's median inter-token gap
    where the capture has it (a mean, TPOT also carries the stalls other requests' prefills put
    into the steps, and those follow the load, not the history), else TPOT."""
    return "itl_p50_s" if np.isfinite(w.r("itl_p50_s")).sum() >= max(w.n_requests / 2, 1) else "tpot_s"


@signal("tpot_growth_per_turn_frac", "fraction/turn")
def tpot_growth(w):
    """Per-token decode time added per turn (median inter-token gap where measured, else TPOT),
    as a share of turn 1's."""
    return _growth_per_turn(w, _decode_step(w))


@signal("context_tokens_per_turn", "tokens/turn")
def context_growth(w):
    """Prompt tokens added per turn (the history the KV cache must hold)."""
    turns, meds = _turn_medians(w, "prompt_tokens")
    if len(turns) < 3:
        return np.nan
    return fit(turns, meds, min_n=3)[0]


@signal("turn_tpot_corr", "rank corr")
def turn_tpot_corr(w):
    """Rank correlation of the per-turn median decode time per token (as tpot_growth_per_turn_frac)
    with turn number."""
    turns, meds = _turn_medians(w, _decode_step(w))
    return fit(turns, meds, min_n=4)[1] if len(turns) >= 4 else np.nan


@signal("turn_ttft_corr", "rank corr")
def turn_ttft_corr(w):
    """Rank correlation of per-turn median TTFT with turn number."""
    turns, meds = _turn_medians(w, "ttft_s")
    return fit(turns, meds, min_n=4)[1] if len(turns) >= 4 else np.nan


def _trend_z(w, column: str) -> float:
    """trend_z of `column` on the turn number within each conversation (one stratum for requests
    without a conversation id), requests that ran while the host was contended left out."""
    turn, v = w.r("turn"), w.r(column)
    calm = ~contended(w)
    m = np.isfinite(turn) & np.isfinite(v) & calm
    if _distinct(turn[m]) < 4:
        return np.nan
    return trend_z(w.prep.session[w.req], turn, v, rows=None if calm.all() else calm)


def _distinct(a: np.ndarray) -> int:
    """How many distinct values ``a`` holds (finite values): a count over a small integer range
    (turn numbers) instead of a sort."""
    if not len(a):
        return 0
    lo, hi = float(a.min()), float(a.max())
    if hi - lo < 2**20 and np.array_equal(a, np.floor(a)):
        return int(np.count_nonzero(np.bincount((a - lo).astype(np.int64))))
    return len(np.unique(a))


@signal("turn_tpot_trend_z", "z")
def turn_tpot_trend_z(w):
    """How consistently a later turn of a conversation decodes slower than an earlier one (per
    request: median inter-token gap where measured, else TPOT): the stratified Mann-Kendall z over
    every pair of requests within one conversation. Unlike a correlation of per-turn medians, it
    uses every request and compares each conversation only with itself, so a batch that happened
    to run beside a long prefill moves it little; 3 is ~1 in 1,000 by chance."""
    return _trend_z(w, _decode_step(w))


@signal("turn_ttft_trend_z", "z")
def turn_ttft_trend_z(w):
    """How consistently a later turn of a conversation waits longer for its first token than an
    earlier one (stratified Mann-Kendall z, as turn_tpot_trend_z)."""
    return _trend_z(w, "ttft_s")


@signal("sessions", "count")
def sessions(w):
    """Distinct conversations with a request in the window."""
    s = w.prep.session[w.req]
    s = s[s >= 0]
    if not len(s):
        return 0.0
    seen = np.zeros(int(s.max()) + 1, dtype=bool)  # conversation codes are dense: a mark each, no sort
    seen[s] = True
    return float(np.count_nonzero(seen))
