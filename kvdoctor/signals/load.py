"""Absolute load signals: is the server slow for *everyone*, not just in its tail?

Relative signals (P99 over P50, high over low concurrency) go quiet when every request is
slow. These compare the window with the run's own low-load baseline (its least-loaded
requests) and apply Little's law (requests in flight = arrival rate x
time in system): a server that keeps up holds about rate x low-load latency requests; one that
does not builds a backlog, and its arrivals outnumber its completions.

They also tell a prefix-cache hit/miss split (TTFT in two clusters, the slow one at the
prompt's own prefill cost) from waiting, which it resembles in a TTFT histogram.
"""
from __future__ import annotations

import numpy as np

from .quantiles import median
from .registry import percentile, ratio, signal

#: the baseline is the least-loaded share of requests (at least MIN_BASELINE of them)
BASELINE_FRAC = 0.05
MIN_BASELINE = 5
MIN_WINDOW = 20
#: two TTFT clusters: the emptiest gap in sorted TTFTs spans at least this factor
BIMODAL_GAP = 4.0
#: a cluster needs this share of the window's requests (and 2 requests) to count
BIMODAL_MIN_FRAC = 0.03
#: with a measured prefill speed, a TTFT under this share of its own prompt's prefill cost is a
#: hit: a miss cannot prefill faster than the unloaded server (the baseline's slower half sets
#: the speed, so misses land near 1x), while a hit that waited behind another prefill fills the
#: log-time gap the split above looks for
HIT_BELOW_PREFILL = 0.5


def _arrivals_known(prep) -> bool:
    """Whether the capture has send times: without them there is no load to judge (the
    window's time axis is then finish times or file order)."""
    return prep.memoised("arrivals_known", lambda: bool(np.isfinite(prep.cap.requests.num("arrival_s")).any()))


def _least_loaded(load: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """Indices of the requests that met the least load: the BASELINE_FRAC (at least
    MIN_BASELINE) with the fewest requests in flight, ties at the cut included."""
    m = ok & np.isfinite(load)
    if m.sum() < MIN_BASELINE:
        return np.array([], dtype=np.int64)
    k = max(MIN_BASELINE, int(np.ceil(BASELINE_FRAC * m.sum())))
    cut = np.partition(load[m], k - 1)[k - 1]  # the k-th least load (no full sort)
    return np.flatnonzero(m & (load <= cut))


def _baseline(prep) -> dict[str, float]:
    """Least-loaded medians of the whole capture (not one window): the run's own reference.
    TTFT from the requests that arrived with the fewest in flight, TPOT from those that
    decoded beside the fewest; a run loaded from its first request gets a loaded baseline, so
    the ratios against it understate, never overstate, a slowdown."""
    return prep.memoised("low_load_baseline", lambda: _low_load(prep))


def _low_load(prep) -> dict[str, float]:
    ok = ~prep.is_error & _arrivals_known(prep)
    out: dict[str, float] = {}
    idx = _least_loaded(prep.col["concurrency"], ok & np.isfinite(prep.col["ttft_s"]))
    if len(idx):
        out["in_flight"] = float(np.max(prep.col["concurrency"][idx]))
        ttft, prompt = prep.col["ttft_s"][idx], prep.col["prompt_tokens"][idx]
        out["ttft_s"] = percentile(ttft, 50)
        # prefill seconds per prompt token from the slower half: requests served from a prefix
        # cache are fast and must not set the cost of a miss
        m = np.isfinite(prompt) & (prompt > 0) & (ttft > 0)
        if m.sum() >= MIN_BASELINE:
            out["prefill_s_per_token"] = percentile(ttft[m] / prompt[m], 75)
    idx = _least_loaded(prep.col["decode_concurrency"], ok & np.isfinite(prep.col["tpot_s"]))
    if len(idx):
        out["tpot_s"] = percentile(prep.col["tpot_s"][idx], 50)
    gen = prep.col["output_tokens"][ok]
    out_tok = float(np.mean(gen[np.isfinite(gen)])) if np.isfinite(gen).any() else np.nan
    if np.isfinite(out_tok):  # the mean request's time in the system, unloaded (Little's law takes means)
        out["e2e_s"] = out.get("ttft_s", np.nan) + max(out_tok - 1, 0) * out.get("tpot_s", np.nan)
    return out


def _base(w, key: str) -> float:
    return _baseline(w.prep).get(key, np.nan)


@signal("low_load_in_flight", "requests")
def low_load_in_flight(w):
    """Most requests in flight when the baseline's requests arrived (the least-loaded 5% of
    the capture): the load the *_over_low_load signals compare with."""
    return _base(w, "in_flight")


@signal("ttft_low_load_p50_s", "s")
def ttft_low_load(w):
    """Median TTFT of the capture's least-loaded requests."""
    return _base(w, "ttft_s")


@signal("tpot_low_load_p50_s", "s")
def tpot_low_load(w):
    """Median TPOT of the requests that decoded beside the fewest others."""
    return _base(w, "tpot_s")


@signal("ttft_over_low_load", "ratio")
def ttft_over_low_load(w):
    """Median TTFT in the window over the low-load median: every request waits longer."""
    return ratio(w.value("ttft_p50_s"), _base(w, "ttft_s"))


@signal("tpot_over_low_load", "ratio")
def tpot_over_low_load(w):
    """Median TPOT in the window over the low-load median: every decode is slower."""
    return ratio(w.value("tpot_p50_s"), _base(w, "tpot_s"))


@signal("prefill_ms_per_1k_tokens_low_load", "ms/1k tokens")
def prefill_cost(w):
    """Prefill cost measured at low load (TTFT per prompt token, slower half): the
    prefill-speed model that expected TTFTs come from."""
    return _base(w, "prefill_s_per_token") * 1e6


def _expected_ttft(w) -> np.ndarray:
    """Each request's TTFT if it were prefilled alone at the low-load speed."""
    cost = _base(w, "prefill_s_per_token")
    return np.maximum(w.r("prompt_tokens") * cost, 0.0)


def _arrival_span(w) -> tuple[float, float, np.ndarray]:
    arr = w.prep.t[w.req]
    arr = arr[np.isfinite(arr)]
    if len(arr) < MIN_WINDOW or not _arrivals_known(w.prep):
        return np.nan, np.nan, arr
    return float(arr[0]), float(arr[-1]), arr


@signal("inflight_over_littles_law", "ratio")
def inflight_over_littles_law(w):
    """Mean requests in flight over the window's arrivals, over what Little's law gives at the
    low-load latency (arrival rate x low-load end-to-end time). Near 1 the server keeps up;
    well above 1 requests spend that many times longer in the system: they wait."""
    a, b, arr = _arrival_span(w)
    if not np.isfinite(a) or b <= a:
        return np.nan
    area = w.prep.mean_in_flight(np.array([a]), np.array([b]))[0]
    rate = (len(arr) - 1) / (b - a)
    return ratio(area, rate * _base(w, "e2e_s"))


@signal("arrivals_over_completions", "ratio")
def arrivals_over_completions(w):
    """Requests that arrived over requests that finished between the window's first and last
    arrival: above 1 a backlog builds (arrivals exceed what the server completes)."""
    a, b, arr = _arrival_span(w)
    fin = w.prep._fin_sorted
    if not np.isfinite(a) or not np.isfinite(fin).any():
        return np.nan
    done = int(np.searchsorted(fin, b, side="right") - np.searchsorted(fin, a, side="left"))
    return ratio(float(len(arr)), float(max(done, 1)))


@signal("ttft_late_over_early", "ratio")
def ttft_late_over_early(w):
    """Median TTFT of the window's last quarter of arrivals over its first quarter, when the
    arrival rate held steady (within 1.5x): TTFT that grows through a run is a backlog."""
    ttft = w.r("ttft_s")
    arr = w.prep.t[w.req]
    m = np.isfinite(ttft) & np.isfinite(arr)
    if m.sum() < MIN_WINDOW or not _arrivals_known(w.prep):
        return np.nan
    ttft, arr = ttft[m], arr[m]
    q = len(arr) // 4
    early, late = slice(0, q), slice(len(arr) - q, len(arr))
    span_e, span_l = arr[q - 1] - arr[0], arr[-1] - arr[len(arr) - q]
    if span_e <= 0 or span_l <= 0 or not (1 / 1.5 <= span_e / span_l <= 1.5):
        return np.nan  # arrivals sped up or slowed down: a rising TTFT could be the new load
    return ratio(median(ttft[late]), median(ttft[early]))


def _modes(w) -> dict[str, float] | None:
    """Split the window's TTFTs into a fast and a slow cluster, both holding enough requests:
    by each request's own prefill cost when the low-load prefill speed is measured (hits under
    HIT_BELOW_PREFILL of it), else at the widest gap in log time when it spans BIMODAL_GAP;
    None when TTFT has one mode."""
    key = "ttft_modes"
    if key in w._cache:
        return w._cache[key]
    out = None
    ttft, prompt, conc = w.r("ttft_s"), w.r("prompt_tokens"), w.r("concurrency")
    m = np.isfinite(ttft) & (ttft > 0)
    n = int(m.sum())
    if n >= MIN_WINDOW:
        t, p, c = ttft[m], prompt[m], conc[m]
        exp = _expected_ttft(w)[m]
        k = max(2, int(np.ceil(BIMODAL_MIN_FRAC * n)))
        fast = slow = None
        hit = t <= HIT_BELOW_PREFILL * exp  # False where the prefill speed is unknown
        n_hit = int(np.count_nonzero(hit))
        if np.count_nonzero(np.isfinite(exp)) >= n / 2 and k <= n_hit <= n - k:
            fast, slow = hit, ~hit  # masks: a million requests are selected faster by mask than by index
        else:  # no measured prefill speed (or no hits by it): the widest gap in log TTFT
            order = np.argsort(t)
            gaps = np.diff(np.log(t[order]))[k - 1:n - k]  # split after index i: i+1 fast, n-i-1 slow
            if len(gaps) and np.exp(gaps.max()) >= BIMODAL_GAP:
                cut = k - 1 + int(np.argmax(gaps))
                fast, slow = order[:cut + 1], order[cut + 1:]
        if fast is not None:
            t_fast, t_slow = median(t[fast]), median(t[slow])
            n_fast = len(fast) if fast.dtype != bool else n_hit
            out = {"fast_frac": n_fast / n, "fast_s": t_fast, "slow_s": t_slow,
                   "prompt_ratio": ratio(percentile(p[slow], 50), percentile(p[fast], 50)),
                   "slow_over_prefill": ratio(t_slow, percentile(exp[slow], 50)),
                   "fast_over_prefill": ratio(t_fast, percentile(exp[fast], 50)),
                   "conc_slow": percentile(c[slow], 50), "conc_fast": percentile(c[fast], 50)}
            # where the engine reports cached prompt tokens per request, the split must be the cache's
            cached = w.r("cached_prompt_tokens")[m]
            if np.count_nonzero(np.isfinite(cached)) >= n / 2:  # else the share below cannot be either
                share = cached / np.where(p > 0, p, np.nan)
                if np.count_nonzero(np.isfinite(share)) >= n / 2:
                    out["cached_fast"], out["cached_slow"] = percentile(share[fast], 50), percentile(share[slow], 50)
    w._cache[key] = out
    return out


@signal("ttft_cache_bimodal", "bool")
def ttft_cache_bimodal(w):
    """1 when TTFT falls in two clusters that prefix-cache hits and misses explain: prompts
    of the same length in both, the fast cluster far below its prefill cost (a hit skips
    prefill), the slow one at its own prefill cost (a miss pays it, nothing more), and the
    slow requests no busier at arrival (they did not wait); where the engine reports cached
    prompt tokens, the fast side mostly cached and the slow side not. 0 when TTFT has one mode
    or the clusters differ otherwise (different prompt lengths, waiting, both sides cached)."""
    md = _modes(w)
    if md is None:
        return 0.0 if w.n_requests >= MIN_WINDOW else np.nan
    same_prompts = 1 / 1.5 <= md["prompt_ratio"] <= 1.5
    # a hit or a miss does not depend on the load a request meets, so both clusters arrived at a
    # server about as busy; slow requests that met a busier one waited (queueing, which this
    # split resembles). Checked with a prefill speed too: a run loaded from its first request
    # measures that speed with waiting in it, and its queued requests then look like misses
    costs = np.isfinite(md["conc_slow"]) and md["conc_slow"] <= md["conc_fast"] + 1
    if np.isfinite(md["slow_over_prefill"]) and np.isfinite(md["fast_over_prefill"]):
        costs = costs and md["slow_over_prefill"] <= 2.0 and md["fast_over_prefill"] <= 0.25
    if "cached_fast" in md:  # a hit skips most of its prefill (the fast side is under half its cost); a miss does not
        costs = costs and md["cached_fast"] >= 0.5 > md["cached_slow"]
    # where only the engine counts its hits (no cached tokens per request), they must fit the split
    # too: a miss has under half its prompt cached, so the cached share of all prompt tokens is at
    # most the fast side's tokens and half the slow side's. More than that, and the slow requests
    # hit as well and waited instead: e.g. several conversations' next turns arriving together, the
    # later ones behind the earlier ones' prefill in the same batch (vLLM multi-turn, 75% of tokens
    # cached, yet 75% of requests in the slow cluster)
    hit = w.value("prefix_hit_rate_achieved")
    if np.isfinite(hit) and "cached_fast" not in md:
        f = md["fast_frac"]
        r = md["prompt_ratio"] if np.isfinite(md["prompt_ratio"]) else 1.0  # slow over fast prompt length
        costs = costs and hit <= (f + 0.5 * (1 - f) * r) / (f + (1 - f) * r)
    return float(bool(same_prompts and costs))


@signal("ttft_fast_mode_frac", "fraction")
def ttft_fast_mode_frac(w):
    """Share of requests in the fast TTFT cluster (prefix-cache hits when ttft_cache_bimodal)."""
    md = _modes(w)
    return md["fast_frac"] if md else np.nan


@signal("ttft_fast_mode_p50_s", "s")
def ttft_fast_mode(w):
    """Median TTFT of the fast cluster."""
    md = _modes(w)
    return md["fast_s"] if md else np.nan


@signal("ttft_slow_mode_p50_s", "s")
def ttft_slow_mode(w):
    """Median TTFT of the slow cluster."""
    md = _modes(w)
    return md["slow_s"] if md else np.nan


@signal("ttft_slow_mode_over_prefill", "ratio")
def ttft_slow_over_prefill(w):
    """Slow cluster's median TTFT over its prompts' prefill cost at low-load speed (about 1:
    the slow requests pay the prefill and do not wait)."""
    md = _modes(w)
    return md["slow_over_prefill"] if md else np.nan


@signal("arrivals_known", "bool")
def arrivals_known(w):
    """1 when the capture has send times (load, rates and waits can be judged); 0 for sources
    without them (llmperf result files), whose requests are in file order."""
    return float(_arrivals_known(w.prep))
