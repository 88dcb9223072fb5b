"""Workload guard: did both sides get the same traffic? And when prompt lengths differ, the
prompt-length buckets that latency is compared within.

Dimensions: arrival rate (Poisson rate-ratio test), prompt- and output-length distributions
(two-sample KS statistic, medians, P95), turn mix (KS on turn numbers) and concurrency. A
dimension *differs* when the difference is both significant and material (see the thresholds
below), so two halves of one steady run do not trip it.

Which of arrival rate and concurrency is the workload: under open-loop load (requests sent at
a rate) concurrency is an outcome (a slower server has more in flight), so only the rate is
compared; under closed-loop load (N clients, each sending when its last request finished) the
concurrency is the setting and the rate the outcome. A side is closed-loop when its in-flight
count at arrival hardly varies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..signals import Prepared
from .stats import ks_2samp, rate_ratio_p

#: a distribution differs when KS p < KS_P and D >= KS_D
KS_P = 0.01
KS_D = 0.1
#: ... and a median, P95 or mean differs by at least this factor
MATERIAL_FACTOR = 1.1
#: a rate or a concurrency setting differs when significant (p < RATE_P) and off by >= 20%
RATE_P = 0.01
RATE_FACTOR = 1.2
#: prompt-length buckets: at most this many quantile buckets, each needing this many requests per side
MAX_BUCKETS = 10
MIN_PER_BUCKET = 10
#: a bucket is like-for-like when the sides' median prompt lengths in it are within this factor
BUCKET_MEDIAN_FACTOR = 1.5


@dataclass
class Check:
    name: str            # arrival_rate, prompt_tokens, output_tokens, turn, concurrency
    label: str
    before: dict[str, float]
    after: dict[str, float]
    statistic: float | None = None   # KS D, or rate ratio
    p_value: float | None = None
    differs: bool = False
    compared: bool = True            # False: shown for information only (an outcome, or absent)
    note: str = ""


@dataclass
class Matching:
    """Prompt-length buckets present on both sides; codes per request (arrival order, -1 = in
    no matched bucket) and the share each bucket weighs in the standardised percentiles."""

    edges: np.ndarray
    codes_before: np.ndarray
    codes_after: np.ndarray
    share: np.ndarray
    buckets: list[dict[str, float]] = field(default_factory=list)
    coverage_before: float = 0.0
    coverage_after: float = 0.0


@dataclass
class Workload:
    checks: list[Check]
    matching: Matching | None
    closed_loop: bool

    @property
    def differs(self) -> bool:
        return any(c.differs for c in self.checks)

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    @property
    def load_differs(self) -> bool:
        """The offered load differs: no bucketing makes latency comparable."""
        return any(c.differs for c in self.checks if c.name in ("arrival_rate", "concurrency"))

    @property
    def output_differs(self) -> bool:
        c = self.check("output_tokens")
        return bool(c and c.differs)

    def first_line(self) -> str | None:
        """'Workloads differ (...): ...' or None when they do not."""
        diff = [c for c in self.checks if c.differs]
        if not diff:
            return None
        what = "; ".join(_describe(c) for c in diff)
        tail = []
        if self.matching is not None:
            tail.append("latency compared within matched prompt-length buckets")
        if self.load_differs:
            tail.append("the load differs, so latency changes are not attributable to the change alone")
        elif self.output_differs:
            tail.append("E2E not compared (output lengths differ)")
        if not tail:
            tail.append("latency verdicts may reflect the workload, not only the change")
        return f"Workloads differ ({what}): " + "; ".join(tail)


def _fmt_tokens(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{v:,.0f}"


def _describe(c: Check) -> str:
    b, a = c.before, c.after
    if c.name in ("prompt_tokens", "output_tokens"):
        # name the quantile that moved most, so "P50 120 → 2,400" or "P95 290 → 6,500"
        def ratio(k):
            x, y = b.get(k, math.nan), a.get(k, math.nan)
            return abs(math.log(max(y, 1e-9) / max(x, 1e-9))) if math.isfinite(x) and math.isfinite(y) else -1
        k = max(("p50", "p95"), key=ratio)
        return f"{c.label} {k.upper()} {_fmt_tokens(b[k])} → {_fmt_tokens(a[k])} tokens"
    if c.name == "arrival_rate":
        return f"arrival rate {b['rate_per_s']:.3g} → {a['rate_per_s']:.3g} req/s"
    if c.name == "concurrency":
        return f"concurrency {b['mean_in_flight']:.1f} → {a['mean_in_flight']:.1f} in flight on average"
    if c.name == "turn":
        return f"turn mix (mean turn {b['mean']:.1f} → {a['mean']:.1f})"
    return c.label


def _in_flight(prep: Prepared) -> float:
    """Time-average requests in flight over the side (Little's law: in-flight time / span)."""
    arr, fin = prep.t, prep.col["finish_s"]
    ok = np.isfinite(arr) & np.isfinite(fin)
    if ok.sum() < 2:
        return math.nan
    span = fin[ok].max() - arr[ok].min()
    return float((fin[ok] - arr[ok]).sum() / span) if span > 0 else math.nan


def _material(db: dict[str, float], da: dict[str, float]) -> bool:
    """Lengths differ by enough to matter: median, P95 or mean off by >= 10% (KS alone calls
    42 vs 43 tokens different when both are nearly constant)."""
    for k in ("p50", "p95", "mean"):
        x, y = db.get(k, math.nan), da.get(k, math.nan)
        if math.isfinite(x) and math.isfinite(y) and max(x, y) > 0 and max(x, y) >= MATERIAL_FACTOR * max(min(x, y), 1e-9):
            return True
    return False


def _dist(x: np.ndarray) -> dict[str, float]:
    x = x[np.isfinite(x)]
    if not len(x):
        return {"n": 0, "p50": math.nan, "p95": math.nan, "mean": math.nan}
    p50, p95 = np.percentile(x, [50, 95])
    return {"n": int(len(x)), "p50": float(p50), "p95": float(p95), "mean": float(x.mean())}


def _ks_check(name: str, label: str, xb: np.ndarray, xa: np.ndarray) -> Check:
    db, da = _dist(xb), _dist(xa)
    if db["n"] < 5 or da["n"] < 5:
        note = "not recorded on both sides" if min(db["n"], da["n"]) == 0 else "too few requests to test"
        return Check(name, label, db, da, compared=False, note=note)
    d, p = ks_2samp(xb, xa)
    return Check(name, label, db, da, d, p, differs=bool(p < KS_P and d >= KS_D and _material(db, da)))


def _arrival(prep: Prepared) -> tuple[int, float]:
    t = prep.t[np.isfinite(prep.t)]
    if len(t) < 2:
        return len(t), math.nan
    # n arrivals span n-1 gaps: rate = (n-1)/span estimates the rate without the edge bias
    return len(t) - 1, float(t[-1] - t[0])


def _closed_loop(prep: Prepared) -> bool | None:
    """Closed-loop load: requests arrive when another one finishes (a client sending its next
    request), not at times of their own. Measured as the distance from each arrival to the
    nearest finish of *another* request (either side: clocks and the proxy may record the
    finish a little after the next send), against the typical gap between arrivals.
    None when there are too few requests to tell."""
    arr, fin = prep.t, prep.col["finish_s"]
    ok = np.isfinite(arr) & np.isfinite(fin)
    if ok.sum() < 10:
        return None
    a, f = arr[ok], fin[ok]
    order = np.argsort(f, kind="stable")
    fs, owner = f[order], np.arange(len(f))[order]
    i = np.searchsorted(fs, a)
    best = np.full(len(a), np.inf)
    for shift in (-2, -1, 0, 1, 2):  # own finish is among the neighbours at most once
        j = i + shift
        valid = (j >= 0) & (j < len(fs))
        jj = np.clip(j, 0, len(fs) - 1)
        d = np.where(valid & (owner[jj] != np.arange(len(a))), np.abs(a - fs[jj]), np.inf)
        best = np.minimum(best, d)
    mean_gap = (a.max() - a.min()) / (len(a) - 1)  # the mean: clustered arrivals (a batch of turns) keep it honest
    best = best[np.isfinite(best)]
    if len(best) < 5 or mean_gap <= 0:
        return None
    return bool(np.median(best) <= 0.1 * mean_gap)


def guard(before: Prepared, after: Prepared) -> Workload:
    checks: list[Check] = []
    nb, tb = _arrival(before)
    na, ta = _arrival(after)
    rate_b = nb / tb if tb and tb > 0 else math.nan
    rate_a = na / ta if ta and ta > 0 else math.nan
    ratio, p = rate_ratio_p(nb, tb, na, ta)
    closed_b, closed_a = _closed_loop(before), _closed_loop(after)
    closed = bool(closed_b and closed_a)
    rate = Check("arrival_rate", "arrival rate", {"rate_per_s": rate_b, "requests": len(before.t)},
                 {"rate_per_s": rate_a, "requests": len(after.t)},
                 None if math.isnan(ratio) else ratio, None if math.isnan(p) else p)
    if closed:
        rate.compared = False
        rate.note = "closed-loop: an outcome, not compared"
    elif math.isfinite(ratio):
        rate.differs = bool(p < RATE_P and max(ratio, 1 / ratio) >= RATE_FACTOR)
    else:
        rate.compared = False
        rate.note = "no arrival times"
    checks.append(rate)
    cb, ca = before.col["concurrency"], after.col["concurrency"]
    conc = Check("concurrency", "concurrency", _dist(cb), _dist(ca))
    conc.before["mean_in_flight"], conc.after["mean_in_flight"] = _in_flight(before), _in_flight(after)
    if closed:  # the setting is the number of clients: the time-average in flight (Little's law)
        b, a = conc.before["mean_in_flight"], conc.after["mean_in_flight"]
        conc.statistic = a / b if b else None
        conc.differs = bool(abs(a - b) >= 0.5 and max(a, b) >= RATE_FACTOR * max(min(a, b), 1e-9))
        conc.note = "closed-loop: the load setting"
    else:
        conc.compared = False
        conc.note = ("open-loop: an outcome, not compared" if closed_b is not None and closed_a is not None
                     else "not compared (too few requests with finish times)")
    checks.append(conc)
    checks.append(_ks_check("prompt_tokens", "prompt length", before.col["prompt_tokens"], after.col["prompt_tokens"]))
    checks.append(_ks_check("output_tokens", "output length", before.col["output_tokens"], after.col["output_tokens"]))
    checks.append(_ks_check("turn", "turn", before.column("turn"), after.column("turn")))
    prompt = checks[2]
    matching = match_buckets(before.col["prompt_tokens"], after.col["prompt_tokens"]) if prompt.differs else None
    return Workload(checks, matching, closed)


def match_buckets(pb: np.ndarray, pa: np.ndarray, max_buckets: int = MAX_BUCKETS) -> Matching | None:
    """Quantile buckets of the pooled prompt lengths, kept where both sides have enough
    requests and comparable prompts; None when no bucket qualifies."""
    fb, fa = pb[np.isfinite(pb)], pa[np.isfinite(pa)]
    if len(fb) < MIN_PER_BUCKET or len(fa) < MIN_PER_BUCKET:
        return None
    k = int(np.clip(min(len(fb), len(fa)) // (4 * MIN_PER_BUCKET), 2, max_buckets))
    pooled = np.concatenate([fb, fa])
    edges = np.unique(np.percentile(pooled, np.linspace(0, 100, k + 1)))
    if len(edges) < 2:
        return None

    def code(p):
        c = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, len(edges) - 2)
        return np.where(np.isfinite(p), c, -1)

    cb, ca = code(pb), code(pa)
    nbk = len(edges) - 1
    keep = np.zeros(nbk, dtype=bool)
    buckets = []
    for s in range(nbk):
        xb, xa = pb[cb == s], pa[ca == s]
        ok = len(xb) >= MIN_PER_BUCKET and len(xa) >= MIN_PER_BUCKET
        if ok:
            mb, ma = np.median(xb), np.median(xa)
            ok = max(mb, ma) <= BUCKET_MEDIAN_FACTOR * max(min(mb, ma), 1.0)
        keep[s] = ok
        buckets.append({"lo": float(edges[s]), "hi": float(edges[s + 1]), "before": int(len(xb)), "after": int(len(xa)),
                        "matched": bool(ok)})
    if not keep.any():
        return None
    remap = np.where(keep, np.cumsum(keep) - 1, -1)
    cb = np.where(cb >= 0, remap[np.maximum(cb, 0)], -1)
    ca = np.where(ca >= 0, remap[np.maximum(ca, 0)], -1)
    n_b = np.bincount(cb[cb >= 0], minlength=int(keep.sum()))
    n_a = np.bincount(ca[ca >= 0], minlength=int(keep.sum()))
    share = (n_b + n_a) / float((n_b + n_a).sum())
    return Matching(edges, cb, ca, share, buckets, float((cb >= 0).mean()), float((ca >= 0).mean()))
