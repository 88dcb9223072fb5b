"""Live KV forecasts for attach mode: when the cache will be full at the current growth rate,
and whether the configured concurrency can fit at the observed P99 request length.

The growth rate is the Theil-Sen slope (median of pairwise slopes) over a recent window, so a
burst of admissions or a sudden drain does not swing the forecast the way a least-squares fit
would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .kvmodel import KV_HEADROOM_FRAC

# The estimator's own settings below (window, minimum points, minimum slope, thinning) are
# numerics of the Theil-Sen fit, not judgements; the judgements are the rules': when a forecast
# warns (kv-pressure-preemption's warn_within_min, on the kv_full_forecast_min signal) and the
# headroom (kvmodel.KV_HEADROOM_FRAC).

#: pairwise slopes are O(n^2); longer windows are thinned evenly to this many samples
_MAX_POINTS = 300


def robust_slope(t: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) by Theil-Sen; intercept is the median of y - slope*t."""
    if len(t) > _MAX_POINTS:
        idx = np.linspace(0, len(t) - 1, _MAX_POINTS).round().astype(int)
        t, y = t[idx], y[idx]
    i, j = np.triu_indices(len(t), k=1)
    dt = t[j] - t[i]
    ok = dt > 0
    if not ok.any():
        return 0.0, float(np.median(y))
    slope = float(np.median((y[j] - y[i])[ok] / dt[ok]))
    return slope, float(np.median(y - slope * t))


def forecast_kv_full(times_s, usage_frac, *, window_s: float = 600.0, full_frac: float = 1.0,
                     min_points: int = 4, min_slope_per_s: float = 1e-6, waiting=None,
                     admit_frac: float | None = None) -> float | None:
    """Minutes until KV usage reaches ``full_frac`` at the recent growth rate, or None when it is
    not growing (or there are too few samples in the last ``window_s`` seconds). 0.0 when full.

    ``usage_frac`` is the engine's KV cache usage as a fraction 0..1 (vLLM kv_cache_usage_perc,
    SGLang token_usage); NaN samples are ignored.

    Full *now* also when, at the latest sample, requests are ``waiting`` for capacity (vLLM's
    num_requests_waiting_by_reason{reason="capacity"}, sampled with the usage) and less than
    ``admit_frac`` of the cache is free (the share one more sequence needs to run to its end,
    in whole blocks). Admission is block-granular: with 1,152 tokens of 128-token blocks and
    311-token sequences, usage sways between 75% and 88% while 4-6 requests wait for blocks,
    never reading 100% though the engine turns every new request away. Both gauges move at once;
    the preemption counter only when a preempted request resumes.
    """
    t = np.asarray(times_s, dtype=float)
    u = np.asarray(usage_frac, dtype=float)
    if t.shape != u.shape:
        raise ValueError(f"times_s and usage_frac differ in length ({t.size} vs {u.size})")
    q = None if waiting is None else np.asarray(waiting, dtype=float)
    if q is not None and q.shape != u.shape:
        raise ValueError(f"waiting and usage_frac differ in length ({q.size} vs {u.size})")
    keep = np.isfinite(t) & np.isfinite(u)
    t, u = t[keep], u[keep]
    if not len(t):
        return None
    order = np.argsort(t, kind="stable")
    t, u = t[order], u[order]
    if q is not None and admit_frac is not None and admit_frac > 0:
        q = q[keep][order]
        if q[-1] > 0 and 1.0 - u[-1] < admit_frac:
            return 0.0
    recent = t >= t[-1] - window_s
    t, u = t[recent], u[recent]
    if u[-1] >= full_frac:
        return 0.0
    if len(t) < min_points:
        return None
    slope, intercept = robust_slope(t - t[0], u)
    if slope <= min_slope_per_s:
        return None
    now = max(intercept + slope * (t[-1] - t[0]), float(u[-1]))
    return max(0.0, (full_frac - now) / slope / 60.0)


@dataclass(frozen=True, slots=True)
class ConcurrencyCheck:
    """Truthy when unsafe: ``max_concurrency`` sequences of ``p99_len_tokens`` need more than the
    cache holds once ``headroom_frac`` of it is kept free."""

    unsafe: bool
    max_concurrency: int
    p99_len_tokens: float
    capacity_tokens: float
    needed_tokens: float
    usable_tokens: float
    safe_concurrency: int

    def __bool__(self) -> bool:
        return self.unsafe

    def message(self) -> str:
        verdict = "cannot fit" if self.unsafe else "fits"
        return (f"configured concurrency {self.max_concurrency} at P99 {self.p99_len_tokens:,.0f} tokens needs "
                f"{self.needed_tokens:,.0f} KV tokens; {self.usable_tokens:,.0f} of {self.capacity_tokens:,.0f} "
                f"usable with headroom: {verdict} (safe: {self.safe_concurrency})")


def unsafe_concurrency(max_concurrency: int, p99_len_tokens: float, capacity_tokens: float,
                       headroom: float = KV_HEADROOM_FRAC) -> ConcurrencyCheck:
    """Whether the configured maximum concurrency fits at the observed P99 length."""
    usable = capacity_tokens * (1 - headroom)
    needed = max_concurrency * p99_len_tokens
    safe = int(math.floor(usable / p99_len_tokens + 1e-9)) if p99_len_tokens > 0 else 0
    return ConcurrencyCheck(unsafe=needed > usable, max_concurrency=int(max_concurrency),
                            p99_len_tokens=float(p99_len_tokens), capacity_tokens=float(capacity_tokens),
                            needed_tokens=float(needed), usable_tokens=float(usable), safe_concurrency=safe)
