"""Counter and histogram arithmetic over engine samples, with Prometheus semantics.

Counters are running totals that drop to (near) zero when the server restarts; a drop is
read as a reset and the new value counts as the increase since it (as PromQL ``rate``).
Histograms are cumulative snapshots (``{"le", "cum", "sum", "count"}``, see neutral.py);
percentiles over a window come from the difference of the snapshots at its two ends, with
linear interpolation inside the bucket holding the rank (as PromQL ``histogram_quantile``).
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

Hist = Mapping[str, Any]


def counter_deltas(v: Sequence[float]) -> np.ndarray:
    """Increase over each interval (length n-1); a fall is a reset, so the increase is the new value."""
    a = np.asarray(v, dtype=float)
    if a.size < 2:
        return np.zeros(0)
    d = np.diff(a)
    return np.where(d < 0, a[1:], d)


def counter_rate(t: Sequence[float], v: Sequence[float]) -> np.ndarray:
    """Per-second rate over each interval between samples (length n-1), resets handled.
    Intervals touching a NaN sample, or of zero or negative length, are NaN."""
    dt = np.diff(np.asarray(t, dtype=float))
    d = counter_deltas(v)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(dt > 0, d / np.where(dt > 0, dt, 1.0), np.nan)


def counter_increase(v: Sequence[float]) -> float:
    """Total increase over the samples given (NaN samples skipped), resets handled."""
    a = np.asarray(v, dtype=float)
    return float(counter_deltas(a[~np.isnan(a)]).sum())


def _norm(h: Hist | None) -> tuple[list[float], list[float], float | None, float | None] | None:
    """(finite bounds, cumulative counts, count, sum); a trailing +Inf bound (or null, as JSON
    writes infinity) is taken as the count."""
    if not h:
        return None
    les, cum = [], []
    count = h.get("count")
    for le, c in zip(h.get("le") or [], h.get("cum") or []):
        le = math.inf if le is None or le in ("+Inf", "Inf") else float(le)
        if math.isinf(le):
            count = c if count is None else count
        else:
            les.append(le)
            cum.append(float(c))
    order = sorted(range(len(les)), key=les.__getitem__)
    return [les[i] for i in order], [cum[i] for i in order], (None if count is None else float(count)), h.get("sum")


def histogram_delta(before: Hist | None, after: Hist | None) -> dict[str, Any] | None:
    """Observations between two snapshots. A reset (count or a bucket fell) or changed bounds
    between them mean the server restarted: the later snapshot alone is the delta."""
    a, b = _norm(after), _norm(before)
    if a is None:
        return None
    les, cum, count, total = a
    if b is not None and b[0] == les:
        reset = any(x < y for x, y in zip(cum, b[1])) or (count is not None and b[2] is not None and count < b[2])
        if not reset:
            cum = [x - y for x, y in zip(cum, b[1])]
            count = None if count is None or b[2] is None else count - b[2]
            total = None if total is None or b[3] is None else total - b[3]
    return {"le": les, "cum": cum, "sum": total, "count": count}


def histogram_quantile(q: float, before: Hist | None, after: Hist | None) -> float:
    """The q-quantile (0..1) of the observations between ``before`` and ``after`` (``before``
    None: since the server started). NaN when nothing was observed or the +Inf count is unknown;
    a rank in the +Inf bucket gives the highest finite bound."""
    d = histogram_delta(before, after)
    if d is None or d["count"] is None or math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    buckets = list(zip(d["le"], d["cum"])) + [(math.inf, d["count"])]
    run = 0.0
    for i, (le, c) in enumerate(buckets):  # PromQL's ensureMonotonic
        run = max(run, c)
        buckets[i] = (le, run)
    total = buckets[-1][1]
    if len(buckets) < 2 or total <= 0:
        return math.nan
    rank = q * total
    b = next(i for i, (_, c) in enumerate(buckets) if c >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, end, count = 0.0, buckets[b][0], buckets[b][1]
    if b > 0:
        start, prev = buckets[b - 1]
        count -= prev
        rank -= prev
    return start + (end - start) * (rank / count) if count > 0 else end


def histogram_count_over(x: float, d: Mapping[str, Any] | None) -> tuple[float, float]:
    """(observations above ``x``, all observations) of a histogram delta (histogram_delta's
    dict), interpolated linearly inside the bucket holding ``x`` as histogram_quantile does, so
    that a quantile over ``x`` and a share over ``x`` agree. (nan, 0) when nothing was observed."""
    if not d or d.get("count") is None or not d["count"]:
        return math.nan, 0.0
    total = float(d["count"])
    start, below, run = 0.0, 0.0, 0.0
    for le, c in zip(d["le"], d["cum"]):
        run = max(run, c)  # PromQL's ensureMonotonic
        if x < le:
            inside = (x - start) / (le - start) if le > start else 1.0
            return total - (below + (run - below) * max(inside, 0.0)), total
        start, below = le, run
    return max(total - run, 0.0) if x < math.inf else 0.0, total


def _series(samples: Any) -> dict[tuple[str, Any], list[tuple[float, Hist]]]:
    """(name, server) → [(time, hist)] from EngineSamples (or dicts), or from a mapping
    name → [(time, hist)] as the capture reader gives it."""
    out: dict[tuple[str, Any], list[tuple[float, Hist]]] = defaultdict(list)
    if isinstance(samples, Mapping):
        for name, rows in samples.items():
            out[(name, None)].extend((float(t), h) for t, h in rows)
        return out
    for s in samples:
        get = s.get if isinstance(s, Mapping) else lambda k, s=s: getattr(s, k, None)
        for name, h in (get("histograms") or {}).items():
            out[(name, get("server"))].append((float(get("time_s")), h))
    return out


def window_histograms(samples: Any, t0: float, t1: float) -> dict[str, dict[str, Any]]:
    """Neutral histogram name → the observations made in [t0, t1], summed over servers.
    Each server's window runs from its last snapshot at or before t0 (else its first inside
    the window) to its last snapshot at or before t1."""
    out: dict[str, dict[str, Any]] = {}
    for (name, _server), rows in _series(samples).items():
        rows.sort(key=lambda r: r[0])
        before = [h for t, h in rows if t <= t0]
        inside = [h for t, h in rows if t0 < t <= t1]
        if not inside:
            continue
        d = histogram_delta(before[-1] if before else inside[0], inside[-1])
        if d is None:
            continue
        prev = out.get(name)
        if prev is None or prev["le"] != d["le"]:
            if prev is None or (d["count"] or 0) > (prev["count"] or 0):
                out[name] = d
            continue
        prev["cum"] = [x + y for x, y in zip(prev["cum"], d["cum"])]
        for k in ("sum", "count"):
            prev[k] = None if prev[k] is None or d[k] is None else prev[k] + d[k]
    return out


def window_quantiles(samples: Iterable[Any] | Mapping[str, Any], t0: float, t1: float,
                     qs: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[str, dict[float, float]]:
    """Neutral histogram name → {q: value} for the observations made in [t0, t1]."""
    return {name: {q: histogram_quantile(q, None, d) for q in qs}
            for name, d in window_histograms(samples, t0, t1).items()}
