"""Prefix reuse, errors and output quality."""
from __future__ import annotations

import numpy as np

from .memory import counter_increase
from .registry import percentile, ratio, signal


@signal("prefix_hit_rate_achieved", "fraction")
def hit_achieved(w):
    """Share of prompt tokens served from the prefix cache (per request, else engine counters)."""
    cached, prompt = w.r("cached_prompt_tokens"), w.r("prompt_tokens")
    m = np.isfinite(cached) & np.isfinite(prompt)
    if m.sum() >= 5:
        return ratio(float(cached[m].sum()), float(prompt[m].sum()))
    for hits, total in (("prefix_cache_hits_total", "prefix_cache_queries_total"),
                        ("cached_prompt_tokens_total", "prompt_tokens_total")):
        h, q = counter_increase(*w.engine(hits)), counter_increase(*w.engine(total))
        if np.isfinite(h) and np.isfinite(q) and q > 0:
            return h / q
    return percentile(w.engine("prefix_cache_hit_rate")[1], 50)


@signal("prefix_hit_rate_achievable", "fraction")
def hit_achievable(w):
    """Share of prompt tokens an ideal prefix cache could serve, from prompt block hashes."""
    ach, prompt = w.r("achievable_cached_tokens"), w.r("prompt_tokens")
    m = np.isfinite(ach) & np.isfinite(prompt)
    if m.sum() < 5:
        return np.nan
    return ratio(float(ach[m].sum()), float(prompt[m].sum()))


@signal("prefix_hit_gap", "fraction")
def hit_gap(w):
    """Achievable minus achieved prefix hit rate: reuse the cache is leaving on the table."""
    return w.value("prefix_hit_rate_achievable") - w.value("prefix_hit_rate_achieved")


def _engine_failures(w) -> tuple[float, float]:
    """(failed, finished) requests from the engine's counters over the window, for captures
    without request records (fleet mode, a scrape alone); NaN where the engine has no such counter."""
    failed = counter_increase(*w.engine("request_failure_total"))
    total = counter_increase(*w.engine("requests_total"))
    if not np.isfinite(total):
        total = counter_increase(*w.engine("request_success_total")) + failed
    return failed, total


@signal("error_rate", "fraction")
def error_rate(w):
    """Share of requests that failed (error or rejected; a client cancelling is not a failure);
    from the engine's failure counter when there are no request records."""
    n = w.n_requests
    if n == 0:
        failed, total = _engine_failures(w)
        return ratio(failed, total) if total >= 5 else np.nan
    return ratio(float(w.prep.is_error[w.req].sum()), n) if n >= 5 else np.nan


@signal("errors", "count")
def errors(w):
    """Failed requests in the window (the engine's failure counter when there are no request records)."""
    if w.n_requests == 0:
        return _engine_failures(w)[0]
    return float(w.prep.is_error[w.req].sum())


def _class_count(w, *names: str) -> float:
    """Requests in the window whose error class (kvdoctor/error_classes.py) is one of ``names``;
    NaN without request records (an engine's failure counter does not say why)."""
    from .prepared import class_codes

    if w.n_requests == 0:
        return np.nan
    codes = w.prep.error_code[w.req]
    return float(sum(np.count_nonzero(codes == c) for c in class_codes(*names)))  # a compare each (np.isin: ~60 us a call)


@signal("context_errors", "count")
def context_errors(w):
    """Requests refused because prompt + output exceed the context a request may use."""
    return _class_count(w, "context_overflow")


@signal("rate_limited_errors", "count")
def rate_limited(w):
    """Requests refused by a rate limit or quota (HTTP 429): a client/gateway limit, not the engine."""
    return _class_count(w, "rate_limited")


@signal("kv_exhausted_errors", "count")
def kv_exhausted(w):
    """Requests that failed because the KV cache or GPU memory ran out (out of memory, no free blocks)."""
    return _class_count(w, "kv_exhausted")


@signal("overload_errors", "count")
def overloaded(w):
    """Requests the server or gateway shed (HTTP 503, queue full, no free slot)."""
    return _class_count(w, "overloaded")


@signal("timeout_errors", "count")
def timeouts(w):
    """Requests that ran past a timeout (HTTP 408/504, timed out)."""
    return _class_count(w, "timeout")


@signal("invalid_request_errors", "count")
def invalid_requests(w):
    """Requests refused as malformed or unauthorised (other HTTP 4xx)."""
    return _class_count(w, "invalid_request")


@signal("server_failure_errors", "count")
def server_failures(w):
    """Requests that failed inside the server (HTTP 5xx, broken stream, no connection)."""
    return _class_count(w, "server_error")


@signal("cancelled_requests", "count")
def cancelled(w):
    """Requests the client cancelled (HTTP 499, disconnect): not failures."""
    return _class_count(w, "cancelled")


@signal("client_flagged_requests", "count")
def client_flagged(w):
    """Completed requests a benchmark client flagged (e.g. llmperf 'too few output tokens'): not failures."""
    return _class_count(w, "client_flag")


@signal("error_rate_max_1m", "fraction")
def error_burst(w):
    """Highest error rate in any one-minute bucket (with at least 5 requests); unknown when the
    capture has no send times."""
    if not w.prep.arrivals_known:
        return np.nan
    t = w.prep.t[w.req]
    err = w.prep.is_error[w.req]
    m = np.isfinite(t)
    if m.sum() < 5:
        return np.nan
    since = t[m] - t[m].min()
    b = np.floor(since / 60)
    b -= b * 60 > since  # floor division exactly (a quotient rounded up to a whole minute goes back), ~10x faster than //
    b = b.astype(np.int64)
    n = np.bincount(b)
    e = np.bincount(b, weights=err[m].astype(float))
    ok = n >= 5
    return float((e[ok] / n[ok]).max()) if ok.any() else np.nan


@signal("oom_events", "count")
def oom_events(w):
    """Out-of-memory events recorded (engine crash or CUDA OOM in its log)."""
    return float(len(w.events("oom")))


@signal("server_restarts", "count")
def restarts(w):
    """Server restarts or outages seen."""
    return float(len(w.events("server-restart")) + len(w.events("server-down")))


@signal("repetition_p50", "fraction")
def repetition(w):
    """Median share of each output that repeats its own earlier n-grams."""
    return w.pct("output_repetition", 50, 5)


@signal("repetition_long_minus_short", "fraction")
def repetition_gap(w):
    """Median repetition of outputs for the longest quarter of prompts minus that for the
    shortest quarter: degeneration that appears only at long context."""
    long_, short = w.medians_by("prompt_tokens", "output_repetition")
    return long_ - short


def _by_length(w, column: str) -> tuple[float, float]:
    """Median of a column for the longest and the shortest quarter of prompts."""
    return w.medians_by("prompt_tokens", column)


@signal("baseline_compared", "bool")
def baseline_compared(w):
    """1 when requests carry a baseline comparison (`kvdoctor quality --capture`), else 0."""
    return float(np.isfinite(w.r("baseline_agreement_frac")).sum() >= 8)


@signal("baseline_forced_compared", "bool")
def baseline_forced_compared(w):
    """1 when requests carry a teacher-forced comparison with a baseline (`kvdoctor quality
    --capture` on llama.cpp or vLLM servers), else 0."""
    return float(np.isfinite(w.r("baseline_forced_agreement_frac")).sum() >= 8)


@signal("baseline_forced_agreement_p50", "fraction")
def forced_agreement(w):
    """Median over requests of the teacher-forced agreement with the baseline: the share of
    positions of the baseline's own continuation where this server picks the same next token
    (llama-perplexity's "same top p"). Each position is judged on the baseline's tokens, so an
    early difference does not carry into the rest as it does between two free-running outputs."""
    return w.pct("baseline_forced_agreement_frac", 50, 8)


@signal("baseline_forced_agreement_long_p50", "fraction")
def forced_agreement_long(w):
    """Median teacher-forced agreement with the baseline at the longest quarter of prompts."""
    return _by_length(w, "baseline_forced_agreement_frac")[0]


@signal("baseline_repetition_gap_long", "fraction")
def baseline_rep_gap(w):
    """At the longest quarter of prompts: median repetition of the outputs minus that of the
    baseline server's outputs for the same prompts."""
    p, r, b = w.r("prompt_tokens"), w.r("output_repetition"), w.r("baseline_output_repetition")
    m = np.isfinite(p) & np.isfinite(r) & np.isfinite(b)
    if m.sum() < 8:
        return np.nan
    hi = np.percentile(p[m], 75)
    sel = m & (p >= hi)
    return float(np.median(r[sel] - b[sel]))


@signal("baseline_agreement_long_p50", "fraction")
def agreement_long(w):
    """Median agreement with the baseline at the longest quarter of prompts (1 = identical)."""
    return _by_length(w, "baseline_agreement_frac")[0]


@signal("baseline_agreement_drop", "fraction")
def agreement_drop(w):
    """Agreement with the baseline at short context minus at long context: divergence that
    grows with context length."""
    long_, short = _by_length(w, "baseline_agreement_frac")
    return short - long_


@signal("prefix_reusable_request_frac", "fraction")
def reusable_request_frac(w):
    """Share of requests whose prompt starts with a block an earlier request already sent (from
    prompt block hashes): those an ideal prefix cache could serve at least in part."""
    ach = w.r("achievable_cached_tokens")
    m = np.isfinite(ach)
    if m.sum() < 5:
        return np.nan
    return float(np.mean(ach[m] > 0))


@signal("misses_reusable", "bool")
def misses_reusable(w):
    """0 when the prompts' prefix hashes show that too few requests could have reused a cached
    prefix to explain the slow cluster as misses (fewer than 20% of requests beyond the fast,
    hit, cluster); 1 otherwise, also when the capture has no hashes (nothing says otherwise)."""
    reusable = w.value("prefix_reusable_request_frac")
    fast = w.value("ttft_fast_mode_frac")
    if not np.isfinite(reusable) or not np.isfinite(fast):
        return 1.0
    return float(reusable - fast >= 0.2)


def cut_at_limit(w) -> np.ndarray | None:
    """Per request of the window: an answered request whose prompt + output filled the
    per-request context limit (the server stopped the answer there); None where the limit is not
    known. Read once a window (the two signals below and the error-rate objective ask)."""
    return _cut(w)[0]


def _cut(w) -> tuple[np.ndarray | None, int]:
    """(cut_at_limit's mask, answered requests with both token counts), memoised on the window."""
    got = w._cache.get("context_cut")
    if got is None:
        limit = w.value("context_limit_tokens")
        got = (None, 0)
        if np.isfinite(limit):
            prompt, out = w.r("prompt_tokens"), w.r("output_tokens")
            m = (w.prep.error_code[w.req] == 0) & np.isfinite(prompt) & np.isfinite(out) & (out > 0)
            # an engine stops a sequence when it fills the context: prompt + output then equals the
            # limit (one token of slack: engines differ on whether the usage counts a start token)
            got = (m & (np.nan_to_num(prompt) + np.nan_to_num(out) >= limit - 1), int(m.sum()))
        w._cache["context_cut"] = got
    return got


def _cut_at_limit(w) -> tuple[int, int]:
    """(answers cut at the context limit, answers with both token counts) of the window's
    successful requests; (0, 0) where the limit is not known."""
    cut, answered = _cut(w)
    return (0, 0) if cut is None else (int(cut.sum()), answered)


@signal("context_cut_requests", "count")
def context_cut_requests(w):
    """Answered requests whose prompt + output filled the per-request context limit: the server
    stopped the answer there, not the model (an end-of-sequence token lands on that exact
    position by chance only)."""
    cut, n = _cut_at_limit(w)
    return float(cut) if n else np.nan


@signal("context_cut_frac", "fraction")
def context_cut_frac(w):
    """Share of answered requests cut off at the context limit (context_cut_requests over the
    answered requests with token counts)."""
    cut, n = _cut_at_limit(w)
    return cut / n if n >= 5 else np.nan
