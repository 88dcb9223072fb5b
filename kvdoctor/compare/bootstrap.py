"""Bootstrap replicates of the statistics a comparison reports, in numpy only.

A percentile's replicates are drawn from the resample's order statistics directly (a resample
of m sorted values is F^-1 of m uniforms, whose order statistics are Beta variates drawn one from
the last: :func:`_order_stat_draws`), O(resamples) a percentile. Other statistics draw replicates
as *counts*: each replicate says how often each original value was drawn, so a ratio of sums is a
matrix product and a stratified resample is counts drawn within each stratum, processed in chunks
of at most :data:`CHUNK_CELLS` cells so memory stays bounded.

Large sides: above :data:`MAX_BOOT_N` values, replicates resample an even random subsample of
m = MAX_BOOT_N values and their spread is rescaled by sqrt(m / n) around the full estimate
(as an m-out-of-n bootstrap does), which keeps the interval's width right while the cost stops
growing with the capture.
"""
from __future__ import annotations

import math
import zlib

import numpy as np

#: resamples per statistic (the issue asks for at least 1,000)
DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 20240607
#: values per side resampled at most (m-out-of-n beyond, rescaled)
MAX_BOOT_N = 20_000
#: replicate-by-value cells held in memory at once
CHUNK_CELLS = 2_000_000


def rng_for(seed: int, *keys: str) -> np.random.Generator:
    """A generator for one statistic on one side, independent of the order statistics are
    computed in (keys: signal name, side)."""
    words = [zlib.crc32(k.encode()) for k in keys]
    return np.random.default_rng(np.random.SeedSequence([seed, *words]))


def _chunks(b: int, n: int):
    step = max(1, CHUNK_CELLS // max(n, 1))
    for lo in range(0, b, step):
        yield lo, min(b, lo + step)


def _counts(rng: np.random.Generator, pools: list[np.ndarray], n_total: int, rows: int, draws: list[int]) -> np.ndarray:
    """(rows, n_total) counts: for each pool (positions into 0..n_total-1), ``draws`` picks
    with replacement among the pool's positions."""
    flat = []
    for pool, k in zip(pools, draws):
        if k == 0 or len(pool) == 0:
            continue
        pick = pool[rng.integers(0, len(pool), size=(rows, k))]
        flat.append((pick + (np.arange(rows) * n_total)[:, None]).ravel())
    if not flat:
        return np.zeros((rows, n_total), dtype=np.int32)
    return np.bincount(np.concatenate(flat), minlength=rows * n_total).reshape(rows, n_total).astype(np.int32)


def weighted_quantiles(xs: np.ndarray, weights: np.ndarray, qs) -> np.ndarray:
    """Inverted-CDF quantiles of sorted values ``xs`` under per-row ``weights`` (rows x n)."""
    w = np.atleast_2d(weights).astype(float)
    cw = np.cumsum(w, axis=1)
    total = cw[:, -1:]
    out = np.empty((w.shape[0], len(qs)))
    for j, q in enumerate(np.atleast_1d(qs)):
        k = (cw < total * (q / 100.0) - 1e-12 * total).sum(axis=1)
        out[:, j] = xs[np.minimum(k, len(xs) - 1)]
    return out


def _shrink(est_full, est_sub, reps, m: int, n: int):
    """Replicates of a size-m subsample, re-centred on the full estimate and scaled to size n."""
    return est_full + (reps - est_sub) * math.sqrt(m / n)


def _order_stat_draws(m: int, ranks: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """(resamples, len(ranks)) positions (0..m-1, into the sorted values) of the ``ranks``-th
    smallest values (ascending, distinct) of bootstrap resamples of m values, drawn exactly and
    jointly without drawing the resamples: a resample is F_m^-1 of m uniforms, so its k-th
    smallest value is F_m^-1(U_(k)), and the uniforms' order statistics come one from the
    last: U_(k) ~ Beta(k+1, m-k); given U_(a), U_(b) = U_(a) + (1 - U_(a)) Beta(b-a, m-b)
    (the (b-a)-th smallest of the m-a-1 uniforms above it). O(resamples) per rank, where
    drawing counts costs O(resamples x m)."""
    u = np.empty((resamples, len(ranks)))
    prev = -1
    for j, k in enumerate(ranks):
        if prev < 0:
            u[:, j] = rng.beta(k + 1, m - k, resamples)
        else:
            u[:, j] = u[:, j - 1] + (1.0 - u[:, j - 1]) * rng.beta(k - prev, m - k, resamples)
        prev = k
    return np.minimum((u * m).astype(np.int64), m - 1)  # F_m^-1(u) = the ceil(u m)-th value


def boot_percentiles(x: np.ndarray, qs, resamples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Point percentiles of x (np.percentile, as the signals compute them) and (resamples, len(qs))
    bootstrap replicates over values (np.percentile's linear interpolation of each resample,
    from its order statistics drawn exactly: :func:`_order_stat_draws`). Empty input: NaN."""
    qs = np.atleast_1d(np.asarray(qs, dtype=float))
    x = x[np.isfinite(x)]
    n = len(x)
    if n == 0:
        return np.full(len(qs), np.nan), np.full((resamples, len(qs)), np.nan)
    est = np.percentile(x, qs)
    sub = np.sort(x if n <= MAX_BOOT_N else rng.choice(x, MAX_BOOT_N, replace=False))
    m = len(sub)
    h = (m - 1) * qs / 100.0
    lo = np.floor(h).astype(np.int64)
    hi = np.minimum(lo + 1, m - 1)
    frac = h - lo
    ranks = np.unique(np.concatenate([lo, hi]))
    pos = _order_stat_draws(m, ranks, resamples, rng)
    v_lo = sub[pos[:, np.searchsorted(ranks, lo)]]
    v_hi = sub[pos[:, np.searchsorted(ranks, hi)]]
    reps = v_lo + frac[None, :] * (v_hi - v_lo)
    if m < n:
        reps = _shrink(est, np.percentile(sub, qs), reps, m, n)
    return est, reps


def boot_stratified_quantiles(x: np.ndarray, strata: np.ndarray, share: np.ndarray, qs, resamples: int,
                              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Quantiles of x standardised to a stratum mix: each stratum s (codes 0..S-1, -1 = left
    out) weighs ``share[s]`` in total, whatever its count on this side. Replicates resample
    within each stratum. Returns (estimate, replicates)."""
    qs = np.atleast_1d(np.asarray(qs, dtype=float))
    keep = np.isfinite(x) & (strata >= 0)
    x, strata = x[keep], strata[keep]
    n = len(x)
    if n == 0 or not np.any((np.bincount(strata, minlength=len(share)) > 0) & (share > 0)):
        return np.full(len(qs), np.nan), np.full((resamples, len(qs)), np.nan)

    def prepare(x, strata):
        order = np.argsort(x, kind="stable")
        xs, st = x[order], strata[order]
        counts_s = np.bincount(st, minlength=len(share))
        unit = np.where(counts_s > 0, share / np.maximum(counts_s, 1), 0.0)  # weight of one value
        return xs, st, unit[st]

    xs, st, w_col = prepare(x, strata)
    est = weighted_quantiles(xs, w_col[None, :], qs)[0]
    if n > MAX_BOOT_N:  # an even subsample (every stratum keeps its share of values)
        pick = rng.choice(n, MAX_BOOT_N, replace=False)
        xs, st, w_col = prepare(x[pick], strata[pick])
    m = len(xs)
    pools = [np.flatnonzero(st == s) for s in range(len(share))]
    reps = np.empty((resamples, len(qs)))
    for lo, hi in _chunks(resamples, m):
        c = _counts(rng, pools, m, hi - lo, [len(p) for p in pools])
        reps[lo:hi] = weighted_quantiles(xs, c * w_col[None, :], qs)
    if m < n:
        reps = _shrink(est, weighted_quantiles(xs, w_col[None, :], qs)[0], reps, m, n)
    return est, reps


def boot_ratio_of_sums(num: np.ndarray, den: np.ndarray, resamples: int, rng: np.random.Generator) -> tuple[float, np.ndarray]:
    """sum(num)/sum(den) over rows where both are finite, and its bootstrap replicates."""
    ok = np.isfinite(num) & np.isfinite(den)
    num, den = num[ok], den[ok]
    n = len(num)
    if n == 0 or den.sum() <= 0:
        return float("nan"), np.full(resamples, np.nan)
    est = float(num.sum() / den.sum())
    if n > MAX_BOOT_N:
        pick = rng.choice(n, MAX_BOOT_N, replace=False)
        num, den = num[pick], den[pick]
    m = len(num)
    reps = np.empty(resamples)
    pool = [np.arange(m)]
    for lo, hi in _chunks(resamples, m):
        c = _counts(rng, pool, m, hi - lo, [m]).astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            reps[lo:hi] = (c @ num) / (c @ den)
    if m < n:
        reps = _shrink(est, float(num.sum() / den.sum()) if den.sum() > 0 else est, reps, m, n)
    return est, reps


def boot_blocks(block_values: np.ndarray, reduce: str, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Block bootstrap over contiguous time blocks: resample the blocks' values (block sums for a
    rate, block maxima for a peak) and reduce each replicate with mean or max."""
    v = block_values[np.isfinite(block_values)]
    if len(v) == 0:
        return np.full(resamples, np.nan)
    idx = rng.integers(0, len(v), size=(resamples, len(v)))
    return v[idx].max(axis=1) if reduce == "max" else v[idx].mean(axis=1)


def boot_turn_growth(turn: np.ndarray, v: np.ndarray, resamples: int, rng: np.random.Generator,
                     min_per_turn: int = 3) -> tuple[float, np.ndarray]:
    """Fitted change per turn of the per-turn median of v, as a share of the first turn's
    median (the tpot_growth_per_turn_frac signal), with replicates resampled within each turn."""
    m = np.isfinite(turn) & np.isfinite(v)
    turn, v = turn[m].astype(np.int64), v[m]
    if len(v) < 2 * min_per_turn:
        return float("nan"), np.full(resamples, np.nan)
    uniq, counts = np.unique(turn, return_counts=True)
    keep = uniq[counts >= min_per_turn]
    if len(keep) < 4:
        return float("nan"), np.full(resamples, np.nan)
    meds = np.empty(len(keep))
    reps = np.empty((resamples, len(keep)))
    for j, k in enumerate(keep):
        est, r = boot_percentiles(v[turn == k], [50], resamples, rng)
        meds[j], reps[:, j] = est[0], r[:, 0]
    t = keep.astype(float)
    tc = t - t.mean()

    def growth(meds_rows: np.ndarray) -> np.ndarray:
        slope = ((meds_rows - meds_rows.mean(axis=-1, keepdims=True)) * tc).sum(axis=-1) / (tc * tc).sum()
        base = meds_rows[..., 0]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(base > 0, slope / base, np.nan)

    return float(growth(meds[None, :])[0]), growth(reps)


def _pooled_estimate(values, owner, strata, share, qs) -> np.ndarray:
    ok = np.isfinite(values) & (strata[owner] >= 0)
    values, owner = values[ok], owner[ok]
    if not len(values):
        return np.full(len(qs), np.nan)
    if len(share) == 1:
        return np.percentile(values, qs)
    per = np.bincount(strata[owner], minlength=len(share)).astype(float)
    unit = np.where(per > 0, share / np.maximum(per, 1), 0.0)
    order = np.argsort(values, kind="stable")
    return weighted_quantiles(values[order], unit[strata[owner[order]]][None, :], qs)[0]


def boot_pooled_quantiles(values: np.ndarray, owner: np.ndarray, n_owners: int, qs, resamples: int,
                          rng: np.random.Generator, strata: np.ndarray | None = None, share: np.ndarray | None = None,
                          max_values: int = MAX_BOOT_N) -> tuple[np.ndarray, np.ndarray]:
    """Percentiles of values pooled over requests (inter-token gaps), resampling *requests*
    (each drawn request brings all its values). With ``strata`` (a code per request, -1 = left
    out) and ``share``, requests are resampled within their stratum and each stratum's values
    weigh its share. Large inputs: the replicates use an even subsample of requests (above
    MAX_BOOT_N, rescaled) and of values (above ``max_values``); the estimate uses everything."""
    qs = np.atleast_1d(np.asarray(qs, dtype=float))
    if strata is None:
        strata, share = np.zeros(n_owners, dtype=np.int64), np.ones(1)
    est = _pooled_estimate(values, owner, strata, share, qs)
    if not np.isfinite(est).all() or n_owners == 0:
        return est, np.full((resamples, len(qs)), np.nan)
    m_owners = n_owners
    if n_owners > MAX_BOOT_N:
        keep_owner = np.zeros(n_owners, dtype=bool)
        keep_owner[rng.choice(n_owners, MAX_BOOT_N, replace=False)] = True
        new_id = np.cumsum(keep_owner) - 1
        sel = keep_owner[owner]
        values, owner, strata = values[sel], new_id[owner[sel]], strata[keep_owner]
        m_owners = MAX_BOOT_N
    ok = np.isfinite(values) & (strata[owner] >= 0)
    values, owner = values[ok], owner[ok]
    est_sub = _pooled_estimate(values, owner, strata, share, qs)
    per = np.bincount(strata[owner], minlength=len(share)).astype(float)
    unit = np.where(per > 0, share / np.maximum(per, 1), 0.0)
    if len(values) > max_values:
        pick = rng.choice(len(values), size=max_values, replace=False)
        values, owner = values[pick], owner[pick]
    order = np.argsort(values, kind="stable")
    xs, own = values[order], owner[order]
    w_gap = unit[strata[own]]
    pools = [np.flatnonzero(strata == s) for s in range(len(share))]
    reps = np.empty((resamples, len(qs)))
    for lo, hi in _chunks(resamples, max(len(xs), m_owners)):
        c = _counts(rng, pools, m_owners, hi - lo, [len(p) for p in pools])
        reps[lo:hi] = weighted_quantiles(xs, c[:, own] * w_gap[None, :], qs)
    if m_owners < n_owners:
        reps = _shrink(est, est_sub, reps, m_owners, n_owners)
    return est, reps
