"""Latency signals: percentiles, tails, and what latency moves with (prompt length,
context length, concurrency, long prompts ahead in the queue)."""
from __future__ import annotations

import numpy as np

from .arrays import is_sorted
from .quantiles import median, percentiles
from .registry import fit, percentile, ratio, signal, split_medians

MIN_REQUESTS = 5

#: (prefix, request column, engine histogram, what it is) -> signals PREFIX_p50_s, _p90_s, _p99_s
PERCENTILE_TABLE = [
    ("ttft", "ttft_s", "ttft_seconds", "time to first token"),
    ("tpot", "tpot_s", "tpot_seconds", "time per output token after the first"),
    ("e2e", "e2e_s", "e2e_seconds", "end-to-end request latency"),
    ("queue", "queue_s", "queue_seconds", "time queued before prefill started"),
]


def _register_percentiles() -> None:
    for prefix, column, hist, what in PERCENTILE_TABLE:
        for q in (50, 90, 99):
            def fn(w, column=column, hist=hist, q=q):
                v = w.pct(column, q, MIN_REQUESTS)
                return v if not np.isnan(v) else w.engine_quantile(hist, q / 100)

            signal(f"{prefix}_p{q}_s", "s", f"P{q} of {what} over requests in the window "
                                            f"(else from the engine's {hist} histogram)")(fn)
        signal(f"{prefix}_p99_over_p50", "ratio", f"P99/P50 of {what}: how heavy the tail is")(
            lambda w, prefix=prefix: ratio(w.value(f"{prefix}_p99_s"), w.value(f"{prefix}_p50_s")))
        signal(f"{prefix}_p90_over_p50", "ratio", f"P90/P50 of {what}: a tail one request in ten is in "
                                                 "(a P99 of a few dozen requests is one request)")(
            lambda w, prefix=prefix: ratio(w.value(f"{prefix}_p90_s"), w.value(f"{prefix}_p50_s")))


_register_percentiles()


@signal("itl_p50_s", "s")
def itl_p50(w):
    """P50 of every inter-token gap in the window (per-request ITL lists, else their P50s)."""
    v = w.itl_values()
    return percentile(v if len(v) else w.r("itl_p50_s"), 50, MIN_REQUESTS)


@signal("itl_p90_s", "s")
def itl_p90(w):
    """P90 of every inter-token gap in the window (else of per-request P50s)."""
    v = w.itl_values()
    return percentile(v if len(v) else w.r("itl_p50_s"), 90, MIN_REQUESTS)


@signal("itl_p99_s", "s")
def itl_p99(w):
    """P99 of every inter-token gap in the window (else of per-request P99s); stalls show here."""
    v = w.itl_values()
    return percentile(v if len(v) else w.r("itl_p99_s"), 99, MIN_REQUESTS)


@signal("itl_p99_over_p50", "ratio")
def itl_tail(w):
    """P99/P50 of inter-token gaps: how long the longest decode stalls are against a step."""
    return ratio(w.value("itl_p99_s"), w.value("itl_p50_s"))


@signal("requests", "count")
def requests(w):
    """Requests that arrived in the window."""
    return w.n_requests


@signal("request_rate_per_s", "1/s")
def request_rate(w):
    """Arrival rate over the window (the engine's request counters when there are no request
    records: received, else finished)."""
    if w.n_requests == 0:
        from .memory import counter_increase

        for name in ("requests_total", "request_success_total"):
            t, v = w.engine(name)
            inc = counter_increase(t, v)
            if np.isfinite(inc) and len(t) > 1 and t[-1] > t[0]:
                return inc / (t[-1] - t[0])
        return np.nan
    return ratio(w.n_requests, w.duration_s)


@signal("output_tokens_per_s", "tokens/s")
def output_rate(w):
    """Generated tokens per second over the window."""
    return ratio(float(np.nansum(w.r("output_tokens"))), w.duration_s)


@signal("prompt_p50_tokens", "tokens")
def prompt_p50(w):
    """Median prompt length."""
    return w.pct("prompt_tokens", 50)


@signal("prompt_p95_tokens", "tokens")
def prompt_p95(w):
    """P95 prompt length: plan capacity from this, not the mean."""
    return w.pct("prompt_tokens", 95)


@signal("prompt_p99_tokens", "tokens")
def prompt_p99(w):
    """P99 prompt length."""
    return w.pct("prompt_tokens", 99)


@signal("prompt_p99_over_p50", "ratio")
def prompt_spread(w):
    """How far the long prompts are from the typical one."""
    return ratio(w.value("prompt_p99_tokens"), w.value("prompt_p50_tokens"))


@signal("ttft_prompt_slope_ms_per_1k_tokens", "ms/1k tokens")
def ttft_slope(w):
    """Extra TTFT per 1,000 prompt tokens (least squares): the prefill cost."""
    return w.fit("prompt_tokens", "ttft_s")[0] * 1e6


@signal("ttft_prompt_corr", "rank corr")
def ttft_corr(w):
    """Rank correlation of TTFT with prompt length (1 = TTFT rises with every longer prompt)."""
    return w.fit("prompt_tokens", "ttft_s")[1]


@signal("ttft_long_over_short", "ratio")
def ttft_long_over_short(w):
    """Median TTFT of the longest 10% of prompts over that of the shorter half."""
    return ratio(*w.medians_by("prompt_tokens", "ttft_s", lo_q=50, hi_q=90, min_n=20))


def _split_by(w, key: str, value: str) -> float:
    """Median of `value` at high `key` (top quarter) over that at low `key` (bottom quarter)."""
    return ratio(*w.medians_by(key, value, min_n=20))


@signal("tpot_context_slope_ms_per_1k_tokens", "ms/1k tokens")
def tpot_ctx_slope(w):
    """Extra TPOT per 1,000 tokens of context: decode reading a longer KV cache."""
    return w.fit("context_tokens", "tpot_s")[0] * 1e6


@signal("tpot_context_corr", "rank corr")
def tpot_ctx_corr(w):
    """Rank correlation of TPOT with context length."""
    return w.fit("context_tokens", "tpot_s")[1]


@signal("tpot_concurrency_corr", "rank corr")
def tpot_conc_corr(w):
    """Rank correlation of TPOT with the mean requests in flight while it decoded: decode
    steps share memory bandwidth among the sequences in the batch."""
    v = w.fit("decode_concurrency", "tpot_s")[1]
    if np.isnan(v) and w.n_requests == 0:
        run, tpot = w.engine_tpot_steps()
        v = fit(run, tpot, min_n=8)[1]
    return v


@signal("tpot_high_over_low_concurrency", "ratio")
def tpot_conc_ratio(w):
    """Median TPOT at high decode concurrency (top quarter) over that at low (bottom quarter)."""
    v = _split_by(w, "decode_concurrency", "tpot_s")
    if np.isnan(v) and w.n_requests == 0:
        run, tpot = w.engine_tpot_steps()
        v = ratio(*split_medians(run, tpot, min_n=8))
    return v


@signal("ttft_high_over_low_concurrency", "ratio")
def ttft_conc_ratio(w):
    """Median TTFT at high concurrency over that at low: waiting for a free slot."""
    return _split_by(w, "concurrency", "ttft_s")


@signal("concurrency_p50", "requests")
def conc_p50(w):
    """Median requests in flight at each arrival."""
    return w.pct("concurrency", 50)


@signal("concurrency_max", "requests")
def conc_max(w):
    """Most requests in flight at any arrival."""
    c = w.r("concurrency")
    return float(np.nanmax(c)) if np.isfinite(c).any() else np.nan


@signal("queue_share_p50", "fraction")
def queue_share(w):
    """Median share of a request's latency spent queued."""
    q, e = w.r("queue_s"), w.r("e2e_s")
    return percentile(q / np.where(e > 0, e, np.nan), 50, MIN_REQUESTS)


@signal("queued_frac", "fraction")
def queued_frac(w):
    """Share of requests that arrived when every slot was busy (in flight > configured slots)."""
    slots = w.prep.config.get("max_running_requests") or w.prep.config.get("parallel")
    c = w.r("concurrency")
    if not slots or not np.isfinite(c).any():
        return np.nan
    c = c[np.isfinite(c)]
    return float(np.mean(c > float(slots)))


@signal("requests_waiting_p50", "requests")
def waiting(w):
    """Median of the engine's waiting-queue gauge."""
    _, v = w.engine("requests_waiting")
    if not len(v) or not np.isfinite(v).any():
        _, v = w.engine("requests_deferred")
    return percentile(v, 50)


@signal("hol_ttft_ratio", "ratio")
def hol_ratio(w):
    """Median TTFT of short requests that arrived while a long prompt was in prefill, over
    that of short requests that did not: head-of-line blocking behind long prefills."""
    p, t = w.r("prompt_tokens"), w.r("ttft_s")
    arr, first = w.prep.t[w.req], w.r("first_token_s")
    m = np.isfinite(p) & np.isfinite(t) & np.isfinite(first)
    if np.count_nonzero(m) < 20:
        return np.nan
    med, p90 = prompt_median_p90(w, m)
    long_ = m & (p >= max(4 * med, p90))
    short = m & (p <= med)
    if long_.sum() < 1 or short.sum() < 10:
        return np.nan
    # a short request is "behind" a long one if it arrived after the long one and before
    # that long request's first token (i.e. while its prefill ran)
    la, lf = arr[long_], first[long_]
    if not is_sorted(la):  # a window's requests are in arrival order already: no sort then
        order = np.argsort(la)
        la, lf = la[order], lf[order]
    lf = np.maximum.accumulate(lf)
    idx = np.searchsorted(la, arr[short], side="right") - 1
    behind = (idx >= 0) & (lf[np.clip(idx, 0, None)] > arr[short])
    ts = t[short]
    if behind.sum() < 3 or (~behind).sum() < 3:
        return np.nan
    return ratio(median(ts[behind]), median(ts[~behind]))


def prompt_median_p90(w, m: np.ndarray) -> tuple[float, float]:
    """(np.median, np.percentile 90) of the prompt lengths of the window's requests under ``m``:
    where a prompt is long. Kept for the last mask (the signals that split short from long
    prompts usually share one: every request's times known)."""
    hit = w._cache.get("prompt_median_p90")
    if hit is not None and np.array_equal(hit[0], m):
        return hit[1]
    p = w.r("prompt_tokens")[m]
    got = median(p), percentiles(p, (90,))[0]
    w._cache["prompt_median_p90"] = (m, got)
    return got
