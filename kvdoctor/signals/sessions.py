"""Per-conversation growth: does each turn get slower as the history (and its KV) grows?"""
from __future__ import annotations

import numpy as np

from .host import contended
from .registry import fit, signal, trend_z

MIN_PER_TURN = 3


def _turn_medians(w, column: str) -> tuple[np.ndarray, np.ndarray]:
    """Median of `column` per turn number, for turns with enough requests: MIN_PER_TURN, or
    every conversation's when fewer are in the window (one conversation at a time is a
    legitimate workload: each turn then has one request). Latencies of requests that ran while
    other processes held the host are left out (signals/host.py)."""
    turn, v = w.r("turn"), w.r(column)
    m = np.isfinite(turn) & np.isfinite(v)
    if column != "prompt_tokens":  # a latency: not while other processes held the host
        m &= ~contended(w)
    n_sessions = w.value("sessions")  # 0 when the capture has no conversation ids
    need = int(min(MIN_PER_TURN, n_sessions)) if n_sessions >= 1 else MIN_PER_TURN
    if m.sum() < 2 * need:
        return np.array([]), np.array([])
    turn, v = turn[m].astype(np.int64), v[m]
    # one float key sorts by turn, then value (cheaper than lexsort): each group's middle is its median
    span = float(v.max() - v.min()) or 1.0
    order = np.argsort(turn + 0.999 * (v - v.min()) / span)
    turn, v = turn[order], v[order]
    uniq, starts, counts = np.unique(turn, return_index=True, return_counts=True)
    keep = counts >= need
    starts, counts = starts[keep], counts[keep]
    lo, hi = starts + (counts - 1) // 2, starts + counts // 2
    return uniq[keep].astype(float), (v[lo] + v[hi]) / 2.0


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
    m = np.isfinite(turn) & np.isfinite(v) & ~contended(w)
    if len(np.unique(turn[m])) < 4:
        return np.nan
    return trend_z(w.prep.session[w.req][m], turn[m], v[m])


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
    return float(len(np.unique(s[s >= 0])))
