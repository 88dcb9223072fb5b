"""When an incident started and ended, from its evidence, not from the evaluation grid.

Rules are judged on rolling windows (5 minutes back, every minute): the first window where a rule
holds says the harm is *in* that window, not when it began. The onset is read off a per-request
series of the harm itself, in arrival order: for a TTFT incident, whether each request's TTFT was
over the tightest TTFT objective or it waited beyond its own prefill by a noticeable second (the
same harm signals/harm.py judges windows by); for decode, TPOT over the objective or a stream that
froze for a second; for errors, whether it failed. Pettitt's test (Pettitt 1979, the rank-based
change-point test) finds the split after which requests are most consistently hurt. A 0/1 series
turns a ramp into a step where the requests start crossing the objective, so a backlog that builds
slowly still gets the instant it began to hurt. The split is accepted only where the test is clear
(p < 0.001) and it lies inside the window where the rule turned active; otherwise the incident
starts where the windows say, or, for a rule active from the capture's first window whose requests
were hurt early in it and not clearly less often than late, where the capture began. The end is
found the same way, a split after which requests are fine again, when the rule went quiet before
the capture ended.
Live (`attach`) and offline (`diagnose`) call the same function, so both report the same onset for
the same data.
"""
from __future__ import annotations

import numpy as np

from ..signals import Prepared
from ..signals.registry import ranks

#: the per-request column a symptom's onset is read from (errors: the failure indicator)
SERIES = {"ttft": "ttft_s", "turn-growth": "ttft_s", "tpot": "tpot_s", "latency": "e2e_s", "errors": "is_error"}
#: Pettitt's approximate p-value must be below this for a split to be an onset (~3.3 sigma)
MAX_P = 1e-3
#: the test runs on at most this many requests (evenly thinned): the split's place is then known
#: to within n / MAX_POINTS requests, and the cost stops growing with traffic
MAX_POINTS = 20_000
MIN_POINTS = 10


def pettitt(y: np.ndarray, direction: str = "up") -> tuple[int, float]:
    """(k, p): the series splits after index k (y[:k+1] | y[k+1:]) where the later part is most
    consistently higher ("up") or lower ("down"), and Pettitt's approximate p-value of that split.
    U_k = 2 * sum(ranks[:k+1]) - (k+1)(n+1) is negative where the early values rank low."""
    n = len(y)
    if n < MIN_POINTS:
        return -1, 1.0
    r = ranks(y)
    u = 2.0 * np.cumsum(r)[:-1] - np.arange(1, n) * (n + 1.0)
    k = int(np.argmin(u) if direction == "up" else np.argmax(u))
    big = abs(float(u[k]))
    p = min(1.0, 2.0 * np.exp(-6.0 * big * big / (float(n) ** 3 + float(n) ** 2)))
    return k, p


def hurt(prep: Prepared, symptom: str, lo: int, hi: int) -> np.ndarray:
    """Per request in [lo, hi) of the arrival order: 1 where it was hurt the way ``symptom`` is judged
    (over the tightest objective of the symptom, or the baseline harm), 0 where not, NaN unknown."""
    from ..signals.harm import NOTICEABLE_S, WAIT_OVER_WORK, request_waits

    col = SERIES.get(symptom)
    if col == "is_error":
        return prep.is_error[lo:hi].astype(float)
    v = prep.col[col][lo:hi]
    kinds = {"ttft_s": ("ttft",), "tpot_s": ("tpot",), "e2e_s": ("e2e",)}[col]
    targets = [t for sig, t in prep.slo.items() if sig.split("_")[0] in kinds and t > 0]
    out = np.where(np.isfinite(v), 0.0, np.nan)
    if targets:
        out = np.where(v > min(targets), 1.0, out)
    if col == "ttft_s":
        wait, unloaded = request_waits(prep, lo, hi)
        out = np.where((wait >= NOTICEABLE_S) & (wait >= WAIT_OVER_WORK * unloaded), 1.0, out)
    elif col == "tpot_s":
        itl_max = prep.col["itl_max_s"][lo:hi]
        out = np.where(itl_max >= NOTICEABLE_S, 1.0, out)
    return out


def _series(prep: Prepared, symptom: str, t0: float, t1: float) -> tuple[np.ndarray, np.ndarray]:
    """(arrival times, harm indicator) of the symptom's requests that arrived in [t0, t1]."""
    col = SERIES.get(symptom)
    if col is None or not prep.arrivals_known:
        return np.array([]), np.array([])
    lo, hi = int(np.searchsorted(prep.t, t0, side="left")), int(np.searchsorted(prep.t, t1, side="right"))
    t = prep.t[lo:hi]
    y = hurt(prep, symptom, lo, hi)
    m = np.isfinite(t) & np.isfinite(y)
    t, y = t[m], y[m]
    if len(t) > MAX_POINTS:
        idx = np.linspace(0, len(t) - 1, MAX_POINTS).astype(np.int64)
        t, y = t[idx], y[idx]
    return t, y


def change_point(prep: Prepared, symptom: str, t0: float, t1: float, direction: str = "up") -> float | None:
    """The instant in [t0, t1] after which the symptom's series is clearly higher ("up") or lower
    ("down"): the arrival of the first request after Pettitt's split; None when there is none."""
    return _split_at(*_series(prep, symptom, t0, t1), direction)


def _split_at(t: np.ndarray, y: np.ndarray, direction: str) -> float | None:
    """change_point on a series already read."""
    if not len(y) or y.min() == y.max():  # all hurt or none: no change inside
        return None
    k, p = pettitt(y, direction)
    if k < 0 or p >= MAX_P:
        return None
    return float(t[k + 1])


def refine_window(prep: Prepared, symptom: str, start: float, end: float, first_eval_s: float,
                  quiet_before_s: float, lookback_s: float, step_s: float) -> tuple[float, float]:
    """An incident's [start, end]: the evaluation windows' span (``start``..``end``, its first run's
    first active evaluation ``first_eval_s`` and the inactive one before it, ``quiet_before_s``,
    -inf when active from the first), narrowed to where its harm series changed (module docstring)."""
    # the first active window ends at the run's first evaluation and holds the onset; from the
    # capture's start when the rule was active from the first evaluation on
    first_eval = first_eval_s if np.isfinite(first_eval_s) else end
    lo = max(prep.start_s, first_eval - max(lookback_s, first_eval - start)) if np.isfinite(quiet_before_s) \
        else prep.start_s
    t, y = _series(prep, symptom, lo, end)
    onset = _split_at(t, y, "up")
    if onset is not None and lo <= onset <= first_eval:
        start = onset
    elif not np.isfinite(quiet_before_s) and _hurt_from_the_start(t[t <= first_eval], y[t <= first_eval]):
        # active in the capture's first window with no split in it: the grid's last step before
        # that evaluation is not where the harm began; it was there when the capture began
        start = lo
    # the end: where requests got faster again, when the rule went quiet before the capture ended
    if end < prep.end_s - 1e-9:
        drop = change_point(prep, symptom, start, min(end + step_s, prep.end_s), "down")
        if drop is not None and drop > start:
            end = min(end, drop)
    return start, max(end, start)


#: one-sided 5%: the later half of the first window is hurt more often than the earlier beyond chance
GREW_Z = 1.645


def _hurt_from_the_start(t: np.ndarray, y: np.ndarray) -> bool:
    """True when a window's harm series (arrival times, 0/1) was hurt early in it (its earlier half)
    and not clearly less often than late (a one-sided two-proportion z under GREW_Z): a harm that
    did not grow inside the window predates it. A fault that began inside it leaves the early half
    calm; without a per-request series the onset is unknown (False)."""
    if len(y) < MIN_POINTS:
        return False
    early = t < (t[0] + t[-1]) / 2
    n1, n2 = int(early.sum()), int((~early).sum())
    if not n1 or not n2 or not y[early].any():
        return False
    p1, p2, pooled = y[early].mean(), y[~early].mean(), y.mean()
    se = np.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    return bool(se == 0 or (p2 - p1) / se < GREW_Z)


def live_onset(prep: Prepared, symptom: str, held_from_s: float, now_s: float, lookback_s: float) -> float:
    """The onset a live incident opening at ``now_s`` reports: the change point in the window
    looked back over, where there is a clear one before its hold began; else the hold's start."""
    lo = max(prep.start_s, now_s - lookback_s)
    onset = change_point(prep, symptom, lo, now_s, "up")
    if onset is not None and lo <= onset <= held_from_s:
        return onset
    return held_from_s
