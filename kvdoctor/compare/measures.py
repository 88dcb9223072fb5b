"""One signal on both sides: the values, the 95% interval of the difference and a verdict.

How each kind of signal gets its interval:

* latency percentiles (TTFT, TPOT, E2E, queue): bootstrap over requests; when the workload
  guard matched prompt-length buckets, percentiles standardised to the pooled bucket mix,
  resampled within buckets;
* ITL percentiles: every inter-token gap pooled, bootstrap over requests (a request brings
  all its gaps);
* per-turn growth: per-turn medians resampled within each turn, slope refitted;
* prefix hit rate: ratio of sums over requests, bootstrap over requests;
* error rate: Newcombe's interval for a difference of two proportions;
* throughput and peaks (KV usage, GPU memory): block bootstrap over contiguous time blocks;
* anything else: the two values, no interval, verdict "n/a".

Verdict: "better"/"worse" only when the difference is significant *and* the relative change is
at least :data:`MIN_REL_CHANGE`; otherwise "no significant change". Significant means rejected
by Holm's step-down over the whole family compared at once (:func:`correct_family`: the headline
signals and the fired rules' impact signals), at a family-wise error rate of 5%: ~17 signals
each tested at 5% would call about one of them better or worse by chance alone in every
comparison. The displayed intervals stay 95% per signal.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from ..signals import REGISTRY, Prepared, Window
from . import bootstrap as B
from . import stats as S
from .workload import Workload

MIN_REL_CHANGE = 0.05
#: time blocks for the block bootstrap (throughput, peaks)
BLOCKS = 20

#: (name, label, unit, better) of the headline signals, in display order
HEADLINE: list[tuple[str, str, str, str]] = [
    *[(f"{p}_p{q}_s", f"{label} P{q}", "s", "lower") for p, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"),
                                                                        ("e2e", "E2E")) for q in (50, 90, 99)],
    ("tpot_growth_per_turn_frac", "TPOT growth per turn", "fraction/turn", "lower"),
    ("prefix_hit_rate_achieved", "prefix hit rate", "fraction", "higher"),
    ("kv_usage_max_frac", "KV usage peak", "fraction", "lower"),
    ("error_rate", "error rate", "fraction", "lower"),
    ("output_tokens_per_s", "throughput", "tokens/s", "higher"),
]
LABELS = {name: label for name, label, _, _ in HEADLINE}
_PCT = re.compile(r"^(ttft|tpot|e2e|queue|itl)_p(\d+)_s$")
_COLUMN = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "queue": "queue_s"}
#: other percentile signals of a request column (rule impacts): never bucket-matched
_REQ_PCT = {"prompt_p50_tokens": ("prompt_tokens", 50.0), "prompt_p95_tokens": ("prompt_tokens", 95.0),
            "prompt_p99_tokens": ("prompt_tokens", 99.0), "repetition_p50": ("output_repetition", 50.0)}
#: signals that are higher-is-better (everything else compared is lower-is-better)
HIGHER_BETTER = {"prefix_hit_rate_achieved", "output_tokens_per_s", "requests", "request_rate_per_s",
                 "prefix_hit_rate_achievable", "baseline_agreement_long_p50"}


@dataclass
class Ctx:
    before: Prepared
    after: Prepared
    wb: Window
    wa: Window
    workload: Workload
    resamples: int = B.DEFAULT_RESAMPLES
    seed: int = B.DEFAULT_SEED
    #: (column, side) -> (estimates at QS, replicates): P50/P90/P99 share one bootstrap
    cache: dict = field(default_factory=dict)


#: the percentiles bootstrapped together for each latency column
QS = (50.0, 90.0, 99.0)


@dataclass
class SignalDiff:
    name: str
    label: str
    unit: str
    better: str                      # "lower" or "higher"
    before: float
    after: float
    iv: S.Interval | None
    method: str
    verdict: str = "n/a"             # better / worse / no significant change / n/a
    matched: bool = False            # compared within matched prompt-length buckets
    comparable: bool = True          # False: the workload difference confounds it
    note: str = ""

    #: Holm-adjusted p-value within the compared family (NaN: not tested)
    p_adjusted: float = math.nan

    @property
    def family(self) -> str:
        return self.label.split(" ")[0]


def judge(d: SignalDiff, significant: bool | None = None) -> str:
    """The verdict of one signal; ``significant`` is the family's decision (None: this signal's
    own 95% interval, before the family is corrected)."""
    if not (math.isfinite(d.before) and math.isfinite(d.after)):
        return "n/a"
    iv = d.iv
    if iv is None or not (math.isfinite(iv.diff_lo) and math.isfinite(iv.diff_hi)):
        return "n/a" if d.before != d.after else "no significant change"
    if significant is None:
        significant = iv.excludes_zero
    if not (significant and iv.excludes_zero) or not abs(iv.rel) >= MIN_REL_CHANGE:
        return "no significant change"
    lower = iv.diff < 0
    return "better" if lower == (d.better == "lower") else "worse"


def _boot_pct(ctx: Ctx, name: str, column: str, q: float, matched: bool):
    out = []
    for side, w, codes in (("before", ctx.wb, _codes(ctx, "before")), ("after", ctx.wa, _codes(ctx, "after"))):
        qs = QS if q in QS else (q,)
        key = (column, side, qs)
        if key not in ctx.cache:
            x = w.r(column)
            rng = B.rng_for(ctx.seed, column, side)
            if matched:
                ctx.cache[key] = B.boot_stratified_quantiles(x, codes[w.req], ctx.workload.matching.share, qs,
                                                             ctx.resamples, rng)
            else:
                ctx.cache[key] = B.boot_percentiles(x, qs, ctx.resamples, rng)
        est, reps = ctx.cache[key]
        j = qs.index(q)
        out.append((float(est[j]), reps[:, j]))
    return out


def _codes(ctx: Ctx, side: str):
    m = ctx.workload.matching
    if m is None:
        return None
    return m.codes_before if side == "before" else m.codes_after


def _itl_gaps(prep: Prepared, w: Window) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Inter-token gaps of the window's requests and the request (window position) of each."""
    if prep.itl is None:
        return None
    offsets, values, order = prep.itl
    rows = order[w.req]
    lengths = (offsets[1:] - offsets[:-1])[rows]
    if lengths.sum() == 0:
        return None
    owner = np.repeat(np.arange(len(rows)), lengths)
    first = np.cumsum(lengths) - lengths  # where each request's gaps start in the output
    idx = np.arange(int(lengths.sum())) - np.repeat(first, lengths) + np.repeat(offsets[rows], lengths)
    return values[idx].astype(float), owner, len(rows)


def _boot_itl(ctx: Ctx, name: str, q: float, matched: bool):
    out = []
    for side, prep, w in (("before", ctx.before, ctx.wb), ("after", ctx.after, ctx.wa)):
        gaps = _itl_gaps(prep, w)
        if gaps is None:  # per-request summaries only (the ITL signals' own fallback): P50 and P99
            col = {50: "itl_p50_s", 99: "itl_p99_s"}.get(int(q))
            if col is None:
                return None
            out.append(_boot_pct(ctx, name, col, q, matched)[0 if side == "before" else 1])
            continue
        qs = QS if q in QS else (q,)
        key = ("itl", side, qs)
        if key not in ctx.cache:
            vals, owner, n = gaps
            strata = share = None
            if matched:
                strata, share = _codes(ctx, side)[w.req], ctx.workload.matching.share
            ctx.cache[key] = B.boot_pooled_quantiles(vals, owner, n, qs, ctx.resamples, B.rng_for(ctx.seed, "itl", side),
                                                     strata, share)
        est, reps = ctx.cache[key]
        j = qs.index(q)
        out.append((float(est[j]), reps[:, j]))
    return out


def _blocks(w: Window, t: np.ndarray, v: np.ndarray, reduce: str) -> np.ndarray:
    """Per-block sums or maxima of v over BLOCKS equal time blocks of the window."""
    m = np.isfinite(t) & np.isfinite(v)
    span = w.t1 - w.t0
    if m.sum() == 0 or span <= 0:
        return np.array([])
    k = np.clip(((t[m] - w.t0) / span * BLOCKS).astype(np.int64), 0, BLOCKS - 1)
    if reduce == "sum":
        return np.bincount(k, weights=v[m], minlength=BLOCKS)
    out = np.full(BLOCKS, -np.inf)
    np.maximum.at(out, k, v[m])
    return np.where(np.isfinite(out), out, np.nan)


def compare_signal(name: str, ctx: Ctx, label: str | None = None) -> SignalDiff:
    """Compare one signal (a headline one, a rule's impact, or any registered signal)."""
    unit = REGISTRY[name].unit if name in REGISTRY else "s"
    better = "higher" if name in HIGHER_BETTER else "lower"
    d = SignalDiff(name, label or LABELS.get(name, name), unit, better, math.nan, math.nan, None, "none")
    wb, wa = ctx.wb, ctx.wa
    wl = ctx.workload
    res = None
    m = _PCT.match(name)
    if m:
        matched = wl.matching is not None
        if m[1] == "itl":
            res = _boot_itl(ctx, name, float(m[2]), matched)
            d.method = "bootstrap over requests, gaps pooled"
        elif min(np.isfinite(wb.r(_COLUMN[m[1]])).sum(), np.isfinite(wa.r(_COLUMN[m[1]])).sum()) >= 5:
            res = _boot_pct(ctx, name, _COLUMN[m[1]], float(m[2]), matched)
            d.method = "bootstrap over requests"
        if res is not None and matched:
            d.matched = True
            d.method += ", within matched prompt-length buckets"
    elif name in _REQ_PCT and all(np.isfinite(w.r(_REQ_PCT[name][0])).sum() >= 5 for w in (wb, wa)):
        res = _boot_pct(ctx, name, *_REQ_PCT[name], matched=False)
        d.method = "bootstrap over requests"
    elif name == "tpot_growth_per_turn_frac":
        res = [B.boot_turn_growth(w.r("turn"), w.r("tpot_s"), ctx.resamples, B.rng_for(ctx.seed, name, side))
               for side, w in (("before", wb), ("after", wa))]
        d.method = "bootstrap within turns"
    elif name == "prefix_hit_rate_achieved" and all(
            (np.isfinite(w.r("cached_prompt_tokens")) & np.isfinite(w.r("prompt_tokens"))).sum() >= 5 for w in (wb, wa)):
        res = [B.boot_ratio_of_sums(w.r("cached_prompt_tokens"), w.r("prompt_tokens"), ctx.resamples,
                                    B.rng_for(ctx.seed, name, side)) for side, w in (("before", wb), ("after", wa))]
        d.method = "bootstrap over requests"
    elif name == "error_rate":
        d.before, d.after = wb.value(name), wa.value(name)
        if math.isfinite(d.before) and math.isfinite(d.after):
            kb, nb = int(ctx.before.is_error[wb.req].sum()), wb.n_requests
            ka, na = int(ctx.after.is_error[wa.req].sum()), wa.n_requests
            d.iv = S.proportion_interval(kb, nb, ka, na)
            d.method = "difference of proportions (Newcombe)"
    elif name == "output_tokens_per_s":
        res = []
        for side, prep, w in (("before", ctx.before, wb), ("after", ctx.after, wa)):
            est = w.value(name)
            blocks = _blocks(w, prep.t[w.req], w.r("output_tokens"), "sum")
            reps = B.boot_blocks(blocks, "mean", ctx.resamples, B.rng_for(ctx.seed, name, side)) * BLOCKS / max(w.duration_s, 1e-9)
            res.append((est, reps if len(blocks) else None))
        d.method = "block bootstrap over time"
    elif name in ("kv_usage_max_frac", "gpu_mem_used_max_frac"):
        res = []
        for side, w in (("before", wb), ("after", wa)):
            if name == "kv_usage_max_frac":
                t, v = w.engine("kv_usage_frac")
            else:
                gt = w.prep.gpu_t
                t = gt[w.gpu] if w.gpu is not None else gt[(gt >= w.t0) & (gt <= w.t1)]
                v = w.gpu_col("mem_used_bytes") / w.gpu_col("mem_total_bytes")
            blocks = _blocks(w, t, v, "max")
            reps = B.boot_blocks(blocks, "max", ctx.resamples, B.rng_for(ctx.seed, name, side)) if len(blocks) else None
            res.append((w.value(name), reps))
        d.method = "block bootstrap over time (peak)"
    if res is not None:
        (eb, rb), (ea, ra) = res
        d.before, d.after = eb, ea
        if math.isfinite(eb) and math.isfinite(ea):
            d.iv = S.interval(eb, ea, rb, ra)
    elif d.iv is None and name in REGISTRY:
        d.before, d.after = wb.value(name), wa.value(name)
        if math.isfinite(d.before) and math.isfinite(d.after):
            d.iv = S.Interval(d.after - d.before, math.nan, math.nan, _rel(d.after, d.before), math.nan, math.nan)
        d.method = "values only (no interval for this signal)"
    _confound(d, wl)
    d.verdict = judge(d)
    return d


def _rel(a: float, b: float) -> float:
    if b == 0:
        return 0.0 if a == b else math.copysign(math.inf, a - b)
    return a / b - 1


def _confound(d: SignalDiff, wl: Workload) -> None:
    if wl.load_differs:
        d.comparable = False
        d.note = "the load differs"
    elif wl.output_differs and (d.name.startswith("e2e_") or d.name == "output_tokens_per_s"):
        d.comparable = False
        d.note = "output lengths differ"


def headline(ctx: Ctx) -> list[SignalDiff]:
    return [compare_signal(name, ctx, label) for name, label, _, _ in HEADLINE]


def correct_family(diffs: list[SignalDiff], alpha: float = S.FAMILY_ALPHA) -> None:
    """Re-judge every signal compared (each once, by name) with Holm's correction over all of
    them: a signal is better or worse only when its hypothesis "no change" is rejected at a
    family-wise error rate of ``alpha``."""
    unique = list({d.name: d for d in diffs}.values())
    p = [d.iv.p if d.iv is not None and d.verdict != "n/a" else math.nan for d in unique]
    reject, adjusted = S.holm(p, alpha)
    by_name = {d.name: (r, a) for d, r, a in zip(unique, reject, adjusted)}
    for d in diffs:
        r, d.p_adjusted = by_name[d.name]
        d.verdict = judge(d, r)
