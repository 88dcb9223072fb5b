"""Prefill/decode interference, read gap by gap from per-request inter-token times.

A continuous-batching engine that schedules a new prompt's prefill in the same step as the
running decodes makes that step as long as the prefill work it carries: every stream decoding
then waits. With per-request ITL lists (the proxy records each chunk's gap) each decode gap
is an interval [t_k-1, t_k] on the capture's clock; the prompt tokens other requests
prefilled inside it are estimated by spreading each request's uncached prompt evenly over its
prefill window [arrival (+ queue when known), first token]. A gap longer than its own
request's median step is a stall; where stalls carry prefill tokens and grow with them, the
prefills are what stall the decodes (the request-level `tpot_prefill_interference_corr` sees
the same effect a whole request at a time).

The gap table is built once per capture; windows select their requests' gaps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..objectives import ROUTE_SEP
from .arrays import is_sorted
from .harm import KINDS, _kind, _route_mask, reading_of, readings
from .latency import prompt_median_p90
from .quantiles import median, percentiles
from .registry import FIT_MIN_X_SPREAD_FRAC, fit, percentile, ratio, signal

#: gaps kept for the table (a stride over each request's gaps beyond it): the (prefill, gap)
#: pairs the overlap weighs grow with gaps x concurrent prefills, so they stay bounded
MAX_GAPS = 200_000
#: a request's own gaps it needs before its median step is a baseline
MIN_GAPS_PER_REQUEST = 4
#: gaps in a window before its interference figures mean anything
MIN_GAPS = 50


@dataclass(frozen=True)
class GapTable:
    """One row per decode gap (sorted by the request's arrival-order row)."""

    row: np.ndarray            # the request's row in arrival order (Prepared order)
    gap_s: np.ndarray          # the inter-token gap
    excess_s: np.ndarray       # gap minus the request's own median gap (its typical step)
    prefill_tokens: np.ndarray  # other requests' prompt tokens estimated prefilled inside the gap
    prompt_max_tokens: np.ndarray  # the longest uncached prompt among the prefills the gap overlaps


def prefill_windows(prep) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, uncached prompt tokens) of each request's prefill in arrival order: from
    arrival (plus its queue time when the server reported one) to its first token."""
    start = prep.t + np.nan_to_num(prep.col["queue_s"])
    end = prep.col["first_token_s"]
    tokens = np.nan_to_num(prep.col["prompt_tokens"]) - np.nan_to_num(prep.col["cached_prompt_tokens"])
    return start, end, np.maximum(tokens, 0.0)


def gap_table(prep) -> GapTable | None:
    """The capture's decode gaps with the prefill tokens they overlap; None without per-request
    ITL lists or arrival times (nothing to align the gaps with)."""
    return prep.memoised("gap_table", lambda: _build(prep) if prep.itl is not None and prep.arrivals_known else None)


def _build(prep) -> GapTable | None:
    offsets, values, order = prep.itl
    first = prep.col["first_token_s"]
    lengths = (offsets[1:] - offsets[:-1])[order]
    keep = (lengths >= MIN_GAPS_PER_REQUEST) & np.isfinite(first) & ~prep.read_late
    rows_kept = np.flatnonzero(keep)
    if not len(rows_kept):
        return None
    # all kept requests' gaps in arrival order, as one vector (no per-request Python loop)
    n = lengths[rows_kept]
    seg = np.concatenate([[0], np.cumsum(n)])
    row = np.repeat(rows_kept, n)
    within = np.arange(seg[-1]) - np.repeat(seg[:-1], n)
    gap = values[np.repeat(offsets[order][rows_kept], n) + within]
    gap = np.where(np.isfinite(gap), gap, 0.0)
    csum = np.cumsum(gap)
    t1 = first[row] + csum - np.repeat(csum[seg[:-1]] - gap[seg[:-1]], n)
    # every stride-th gap of each request beyond MAX_GAPS in all: memory and sorting stay
    # bounded while each kept gap keeps its true place on the clock (the cumulative sums above
    # ran over all its gaps) and the median step is read from the kept ones
    stride = max(1, -(-len(gap) // MAX_GAPS))
    if stride > 1:
        sel = within % stride == 0
        row, t1, gap = row[sel], t1[sel], gap[sel]
        n = -(-n // stride)
        seg = np.concatenate([[0], np.cumsum(n)])
    # each request's median gap: sort within requests, read the middle one or two
    srt = gap[np.lexsort((gap, row))]
    med = (srt[seg[:-1] + (n - 1) // 2] + srt[seg[:-1] + n // 2]) / 2
    exc = gap - np.repeat(med, n)
    t0 = t1 - gap
    start, end, tokens = prefill_windows(prep)
    tok_in_gap, tok_max = _prefill_tokens_in_gaps(row, t0, t1, gap, start, end, tokens)
    by_row = np.argsort(row, kind="stable")
    return GapTable(row[by_row], gap[by_row], exc[by_row], tok_in_gap[by_row], tok_max[by_row])


#: (prefill, gap) pairs _prefill_tokens_in_gaps handles at once: ~50 MB of index arrays at most
MAX_PAIRS = 1 << 20


def _prefill_tokens_in_gaps(row, t0, t1, gap, start, end, tokens) -> tuple[np.ndarray, np.ndarray]:
    """Per gap [t0, t1] of request ``row``: the prompt tokens other requests' prefills put inside
    it (each prompt spread over its window [start, end]) and the longest of those prompts. Every
    (prefill, gap that may overlap it) pair at once, prefill by prefill in arrival order as
    batches of pairs: a gap's tokens add up in the order a loop over prefills would add them."""
    tok_in_gap = np.zeros(len(gap))
    tok_max = np.zeros(len(gap))
    ok = np.flatnonzero(np.isfinite(start) & np.isfinite(end) & (end > start) & (tokens > 0))
    if not len(ok) or not len(gap):
        return tok_in_gap, tok_max
    order_t0 = np.argsort(t0, kind="stable")
    s0 = t0[order_t0]
    max_gap = float(gap.max())
    # gaps overlapping [start, end]: they begin before `end` and no earlier than start - max_gap
    lo = np.searchsorted(s0, start[ok] - max_gap, side="left")
    count = np.maximum(np.searchsorted(s0, end[ok], side="left") - lo, 0)
    ends = np.cumsum(count)
    b0 = 0
    while b0 < len(ok):  # batches of prefills, each up to MAX_PAIRS pairs (or one prefill's)
        b1 = max(int(np.searchsorted(ends, (ends[b0 - 1] if b0 else 0) + MAX_PAIRS, side="right")), b0 + 1)
        c = count[b0:b1]
        j = np.repeat(ok[b0:b1], c)
        first_pair = np.repeat(np.cumsum(c) - c, c)
        idx = order_t0[np.repeat(lo[b0:b1], c) + (np.arange(len(j)) - first_pair)]
        mine = row[idx] != j  # a request's own prefill ends before its first gap
        idx, j = idx[mine], j[mine]
        overlap = np.minimum(t1[idx], end[j]) - np.maximum(t0[idx], start[j])
        pos = overlap > 0
        idx, j, overlap = idx[pos], j[pos], overlap[pos]
        np.add.at(tok_in_gap, idx, tokens[j] * overlap / (end[j] - start[j]))
        np.maximum.at(tok_max, idx, tokens[j])
        b0 = b1
    return tok_in_gap, tok_max


def window_gaps(w) -> GapTable | None:
    """The gaps of the window's requests; None when the capture has none or too few."""
    key = "gaps"
    if key not in w._cache:
        table = gap_table(w.prep)
        out = None
        if table is not None:
            lo, hi = np.searchsorted(table.row, [w.req.start, w.req.stop], side="left")
            if hi - lo >= MIN_GAPS:
                out = GapTable(*(a[lo:hi] for a in (table.row, table.gap_s, table.excess_s, table.prefill_tokens,
                                                    table.prompt_max_tokens)))
        w._cache[key] = out
    return w._cache[key]


#: gaps overlapping a prefill before a fit of stall on prefill tokens is made
MIN_OVERLAP_GAPS = 8
#: a gap is a stall when at least this many times its request's median step: a step that
#: carries prefill work is at least one more step long, where the jitter of plain steps rarely
#: reaches (on random gamma-distributed steps the stall share stays under 0.1)
STALL_OVER_STEP = 2.0


def _hit(g: GapTable) -> np.ndarray:
    return g.prefill_tokens > 0


def _fit(w, key: str, x_of) -> tuple[float, float, int]:
    if key not in w._cache:
        g = window_gaps(w)
        out = (float("nan"), float("nan"), 0)
        if g is not None:
            hit = _hit(g)
            out = fit(x_of(g)[hit], g.excess_s[hit], min_n=MIN_OVERLAP_GAPS, min_spread_frac=FIT_MIN_X_SPREAD_FRAC)
        w._cache[key] = out
    return w._cache[key]


@signal("itl_prefill_stall_corr", "rank corr")
def stall_corr(w):
    """Rank correlation, over the decode gaps that overlap other requests' prefills, of a gap's
    excess over its request's median step with the longest prompt among those prefills (needs
    per-request ITL): high when a stall lasts as long as the prompt it carries (unchunked
    prefill). The longest prompt, not the tokens credited to the gap: those grow with the gap's
    own length and would correlate with any noise."""
    return _fit(w, "stall_fit_max", lambda g: g.prompt_max_tokens)[1]


@signal("itl_prefill_stall_ms_per_1k_tokens", "ms/1k tokens")
def stall_slope(w):
    """Least-squares extra decode-gap time per 1,000 prompt tokens estimated prefilled inside the
    gap (each prompt spread over its prefill window): what a prefill token costs every running
    stream; near the server's own prefill cost per token when prefills share the steps."""
    return _fit(w, "stall_fit_tokens", lambda g: g.prefill_tokens)[0] * 1e6


@signal("itl_prefill_stall_share", "fraction")
def stall_share(w):
    """Share of all decode-gap time that is stall (a gap of 2x its request's median step or
    more, counted above that median) in gaps overlapping other requests' prefills: the part of
    TPOT that prefills sharing the steps add."""
    g = window_gaps(w)
    if g is None:
        return float("nan")
    step = g.gap_s - g.excess_s
    stalled = g.excess_s[_hit(g) & (g.gap_s >= STALL_OVER_STEP * step)].sum()
    return ratio(float(stalled), float(g.gap_s.sum()))


@signal("itl_prefill_overlap_over_plain_p50", "ratio")
def overlap_over_plain(w):
    """Median decode gap overlapping other requests' prefills over the median gap overlapping
    none: how much longer a step carrying prefill work is than a plain decode step (chunked
    prefill keeps this above 1 with stalls that no longer grow with the prompt)."""
    g = window_gaps(w)
    if g is None:
        return float("nan")
    hit = _hit(g)
    if hit.sum() < 5 or (~hit).sum() < 5:
        return float("nan")
    return ratio(percentile(g.gap_s[hit], 50), percentile(g.gap_s[~hit], 50))


@signal("itl_long_prefill_overlap_over_plain_p50", "ratio")
def long_overlap_over_plain(w):
    """The decode gap a running stream sits in at the typical moment of a long prompt's prefill
    (uncached prompt at least max(4x the median uncached prompt, its P90); the median weighted by each
    gap's duration) over the median plain gap. An engine that prefills a long prompt whole in
    one step freezes each stream once, for the whole prefill: by count that gap is one of three
    (the steps at the window's edges are plain) and the many short prompts' prefills pull the
    all-prefills median back to a plain step; by time it is nearly all of the window."""
    g = window_gaps(w)
    if g is None:
        return float("nan")
    _, _, tokens = prefill_windows(w.prep)  # the uncached prompts prompt_max_tokens is made of
    uncached = tokens[w.req][np.isfinite(w.r("prompt_tokens"))]
    if len(uncached) < 5:
        return float("nan")
    p50, p90 = percentiles(uncached, (50, 90))
    long_, plain = g.prompt_max_tokens >= max(4 * p50, p90), ~_hit(g)
    if long_.sum() < 5 or plain.sum() < 5:
        return float("nan")
    gaps = np.sort(g.gap_s[long_])
    at = np.cumsum(gaps)
    return ratio(float(gaps[np.searchsorted(at, at[-1] / 2)]), percentile(g.gap_s[plain], 50))


@signal("short_tpot_long_inflight_ratio", "ratio")
def short_tpot_long(w):
    """Median TPOT of short requests (prompt at most the median) whose decode overlapped a
    long request in flight (prompt at or above max(4 x median, P90)), over that of short
    requests whose decode did not: the long minority slowing the short majority's decode."""
    p, tpot = w.r("prompt_tokens"), w.r("tpot_s")
    arr, first, fin = w.prep.t[w.req], w.r("first_token_s"), w.r("finish_s")
    m = np.isfinite(p) & np.isfinite(arr) & np.isfinite(fin)
    if np.count_nonzero(m) < 20:
        return float("nan")
    med, p90 = prompt_median_p90(w, m)
    long_ = m & (p >= max(4 * med, p90))
    short = m & (p <= med) & np.isfinite(tpot) & np.isfinite(first)
    if long_.sum() < 1 or short.sum() < 10:
        return float("nan")
    # a short decode [first, fin] overlaps a long flight [la, lf] when some long one began before
    # the decode ended and was still in flight after it began: among longs sorted by start, the
    # latest end of those starting before `fin` must exceed `first`
    la, lf = arr[long_], fin[long_]
    if not is_sorted(la):  # a window's requests are in arrival order already: no sort then
        order = np.argsort(la, kind="stable")
        la, lf = la[order], lf[order]
    lf = np.maximum.accumulate(lf)
    idx = np.searchsorted(la, fin[short], side="left") - 1
    hit = (idx >= 0) & (lf[np.clip(idx, 0, None)] > first[short])
    t = tpot[short]
    if hit.sum() < 3 or (~hit).sum() < 3:
        return float("nan")
    return ratio(median(t[hit]), median(t[~hit]))


# -- counterfactual: the objective without the stalls -----------------------------------------
# A shape (stalls hold a third of decode time) says prefills share the steps; whether that is what
# hurts users is a question for the objective: take each stall's excess over its request's own
# step out of that request's decode time (what a step that carried no prefill would have cost)
# and read the TPOT objectives again. Where every broken one would then hold, the stalls are the
# breach, however small their share; where one would still be broken, something else breaks it
# too. No threshold of its own: the stall is the gap table's (2x the request's step, overlapping a
# prefill), the objectives and the breach test are the user's (signals/harm.py).


def _stall_excess(g: GapTable) -> np.ndarray:
    """Each gap's stall: its excess over the request's step where it overlaps a prefill and is
    2x that step or more (what itl_prefill_stall_share adds up), else 0."""
    step = g.gap_s - g.excess_s
    return np.where(_hit(g) & (g.gap_s >= STALL_OVER_STEP * step), g.excess_s, 0.0)


def tpot_without_stalls(w) -> np.ndarray | None:
    """Each of the window's requests' TPOT with its prefill stalls taken out of its decode time
    (scaled by the stalled share of its recorded gaps, so a strided gap table reads the same);
    requests with no gaps recorded keep their TPOT. None without a gap table."""
    key = "tpot_without_stalls"
    if key not in w._cache:
        g = window_gaps(w)
        out = None
        if g is not None:
            n = w.req.stop - w.req.start
            local = g.row - w.req.start
            stalled = np.bincount(local, weights=_stall_excess(g), minlength=n)
            total = np.bincount(local, weights=g.gap_s, minlength=n)
            kept = np.divide(total - stalled, total, out=np.ones(n), where=total > 0)
            out = w.r("tpot_s") * kept
        w._cache[key] = out
    return w._cache[key]


@signal("tpot_p99_without_prefill_stalls_s", "s")
def tpot_p99_without_stalls(w):
    """TPOT P99 with every prefill stall taken out of the decode time it sits in: what the
    window's streams would have seen had no step carried another request's prefill."""
    v = tpot_without_stalls(w)
    return float("nan") if v is None else percentile(v, 99, MIN_OVERLAP_GAPS)


@signal("tpot_breach_without_prefill_stalls", "bool")
def tpot_breach_without_stalls(w):
    """1 when a broken TPOT (or ITL) objective would still be broken with every prefill stall
    taken out of the decode time (per request for TPOT, per gap for ITL), 0 when each broken one
    would then hold: the stalls are the breach. NaN when none is broken or there is no gap table."""
    broken = [r for r in readings(w) if _kind(r.signal) in KINDS["tpot"] and r.broken]
    tpot = tpot_without_stalls(w)
    if not broken or tpot is None:
        return float("nan")
    g = window_gaps(w)
    for r in broken:
        sig, _, route = r.signal.partition(ROUTE_SEP)
        if _kind(sig) == "itl":
            if route:  # a route's ITL objective is read from per-request P99s: no gaps to take out
                return 1.0
            v = g.gap_s - _stall_excess(g)
        else:
            v = tpot if not route else tpot[_route_mask(w, route)]
        if reading_of(r.signal, r.target, v).broken:
            return 1.0
    return 0.0
