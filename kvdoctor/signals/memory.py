"""KV cache and GPU memory: usage, headroom, growth, preemption, bandwidth, capacity."""
from __future__ import annotations

import numpy as np

from ..engines import rates
from .registry import fit, percentile, ratio, signal

#: KV cache dtypes that are quantised (below 16 bits), as engines spell them
QUANTISED_KV = ("fp8", "int8", "int4", "q8", "q4", "q5", "iq4", "e4m3", "e5m2")


def _finite_max(v: np.ndarray) -> float:
    v = v[np.isfinite(v)]
    return float(v.max()) if len(v) else np.nan


@signal("kv_usage_max_frac", "fraction")
def kv_usage_max(w):
    """Highest KV cache usage the engine reported."""
    return _finite_max(w.engine("kv_usage_frac")[1])


@signal("kv_usage_p50_frac", "fraction")
def kv_usage_p50(w):
    """Median KV cache usage the engine reported."""
    return percentile(w.engine("kv_usage_frac")[1], 50)


@signal("kv_growth_frac_per_min", "fraction/min")
def kv_growth(w):
    """Fitted growth of KV usage per minute over the window."""
    t, v = w.engine("kv_usage_frac")
    return fit(t, v, min_n=5)[0] * 60


def counter_increase(t: np.ndarray, v: np.ndarray) -> float:
    """Increase of a counter over the window's samples (resets handled); NaN with < 2 samples."""
    v = v[np.isfinite(v)]
    return rates.counter_increase(v) if len(v) >= 2 else np.nan


@signal("preemptions_per_min", "1/min")
def preemptions(w):
    """Sequences preempted (evicted from the KV cache and recomputed) per minute."""
    t, v = w.engine("preemptions_total")
    inc = counter_increase(t, v)
    span = (t[-1] - t[0]) if len(t) > 1 else 0
    return ratio(inc * 60, span)


@signal("gpu_mem_used_max_frac", "fraction")
def gpu_mem_max(w):
    """Highest share of GPU memory in use on any GPU."""
    return _finite_max(w.gpu_col("mem_used_bytes") / w.gpu_col("mem_total_bytes"))


@signal("gpu_mem_headroom_min_bytes", "bytes")
def gpu_headroom(w):
    """Least free GPU memory seen on any GPU."""
    free = w.gpu_col("mem_total_bytes") - w.gpu_col("mem_used_bytes")
    free = free[np.isfinite(free)]
    return float(free.min()) if len(free) else np.nan


def _growth_mib_per_h(t: np.ndarray, v: np.ndarray) -> tuple[float, float]:
    slope, corr, n = fit(t, v, min_n=10)
    return slope * 3600 / 2**20, corr


@signal("gpu_mem_growth_mib_per_h", "MiB/h")
def gpu_growth(w):
    """Fitted growth of GPU memory used, MiB per hour (summed over GPUs per instant)."""
    return _growth_mib_per_h(w.gpu_col("time_s"), w.gpu_col("mem_used_bytes"))[0]


@signal("gpu_mem_growth_corr", "rank corr")
def gpu_growth_corr(w):
    """How steadily GPU memory rises with time (1 = never falls back)."""
    return _growth_mib_per_h(w.gpu_col("time_s"), w.gpu_col("mem_used_bytes"))[1]


@signal("server_rss_growth_mib_per_h", "MiB/h")
def rss_growth(w):
    """Fitted growth of the server process tree's resident memory, MiB per hour."""
    return _growth_mib_per_h(w.host_col("time_s"), w.host_col("server_rss_bytes"))[0]


@signal("server_rss_growth_corr", "rank corr")
def rss_growth_corr(w):
    """How steadily the server's resident memory rises with time."""
    return _growth_mib_per_h(w.host_col("time_s"), w.host_col("server_rss_bytes"))[1]


#: standard deviations of Poisson counting noise a change of request rate must exceed to count
LOAD_NOISE_SD = 2.0


@signal("load_change_frac", "fraction")
def load_change(w):
    """Change of request rate from the first half of the window to the second (0 = flat). A
    difference within the counting noise of a steady rate (Poisson: the halves' difference has a
    standard deviation of sqrt(first + second)) reads 0: at 0.4 requests/s a 5-minute window's
    halves hold ~60 requests each and differ by 25-40% by chance alone, which no load changed."""
    t = w.prep.t[w.req]
    if len(t) < 20 or not w.prep.arrivals_known:
        return np.nan
    mid = (w.t0 + w.t1) / 2
    first, second = int(np.sum(t < mid)), int(np.sum(t >= mid))
    if abs(second - first) <= LOAD_NOISE_SD * np.sqrt(first + second):
        return 0.0
    return ratio(float(second - first), float(max(first, 1)))


@signal("mem_bw_util_p50", "fraction")
def bw_p50(w):
    """Median memory-bandwidth utilisation (GPM DRAM bandwidth, else NVML memory utilisation)."""
    v = w.gpu_col("dram_bw_util_frac")
    if not np.isfinite(v).any():
        v = w.gpu_col("mem_util_frac")
    return percentile(v, 50)


@signal("mem_bw_util_p90", "fraction")
def bw_p90(w):
    """P90 memory-bandwidth utilisation."""
    v = w.gpu_col("dram_bw_util_frac")
    if not np.isfinite(v).any():
        v = w.gpu_col("mem_util_frac")
    return percentile(v, 90)


def _config_number(w, *keys: str) -> float:
    for k in keys:
        v = w.prep.config.get(k)
        if isinstance(v, (int, float)) and v > 0:
            return float(v)
    return np.nan


@signal("context_limit_tokens", "tokens")
def context_limit(w):
    """Longest sequence the server accepts (per slot for llama.cpp, max_model_len for vLLM)."""
    return _config_number(w, "context_len_tokens", "max_model_len", "context_length", "n_ctx")


@signal("kv_capacity_tokens", "tokens")
def kv_capacity(w):
    """Tokens the whole KV cache holds (vLLM blocks x block size, SGLang max_total_num_tokens,
    llama.cpp total n_ctx)."""
    cap = _config_number(w, "kv_capacity_tokens", "max_total_num_tokens")
    if np.isnan(cap):
        cap = _config_number(w, "kv_num_gpu_blocks", "num_gpu_blocks") * _config_number(w, "kv_block_size_tokens", "block_size")
    if np.isnan(cap):  # llama.cpp: each slot holds its own context_len tokens
        cap = _config_number(w, "context_len_tokens") * _config_number(w, "max_running_requests", "parallel")
    return cap


@signal("max_concurrency_configured", "requests")
def max_conc(w):
    """Most sequences the server will run at once (max_num_seqs, --parallel, ...)."""
    return _config_number(w, "max_running_requests", "max_num_seqs", "parallel", "total_slots")


@signal("sequence_p99_tokens", "tokens")
def seq_p99(w):
    """P99 of prompt + output tokens: what one sequence's KV must hold at worst."""
    return w.pct("context_tokens", 99)


@signal("prompt_p99_over_limit", "fraction")
def prompt_over_limit(w):
    """P99 prompt+output length as a share of the context limit."""
    return ratio(w.value("sequence_p99_tokens"), w.value("context_limit_tokens"))


@signal("kv_demand_over_capacity", "ratio")
def kv_demand(w):
    """Configured concurrency x P99 sequence length over the KV capacity with 20% headroom
    (plan.kvmodel.KV_HEADROOM_FRAC, the plan's own margin): above 1, the configuration cannot
    hold its worst case."""
    from ..plan.kvmodel import KV_HEADROOM_FRAC

    demand = w.value("max_concurrency_configured") * w.value("sequence_p99_tokens")
    return ratio(demand, (1 - KV_HEADROOM_FRAC) * w.value("kv_capacity_tokens"))


@signal("kv_usage_over_token_demand", "ratio")
def kv_frag(w):
    """Engine-reported KV usage over the usage that in-flight tokens explain; far above 1
    means blocks are held but not filled (fragmentation, leaked or oversized blocks)."""
    used = w.value("kv_usage_p50_frac")
    cap = w.value("kv_capacity_tokens")
    if np.isnan(used) or np.isnan(cap):  # unknown whatever the demand (engine metrics absent)
        return np.nan
    conc = w.value("concurrency_p50")
    ctx = w.pct("context_tokens", 50)
    return ratio(used, ratio(conc * ctx, cap))


@signal("kv_dtype_quantised", "bool")
def kv_quantised(w):
    """1 when the KV cache is stored below 16 bits (fp8, int8, q4_0, ...), 0 when not, NaN unknown."""
    cfg = w.prep.config
    vals = [str(cfg[k]).lower() for k in ("kv_cache_dtype", "cache_dtype", "cache_type_k", "cache_type_v") if cfg.get(k)]
    if not vals:
        return np.nan
    return float(any(any(q in v for q in QUANTISED_KV) for v in vals))


@signal("kv_full_forecast_min", "min")
def kv_full_forecast(w):
    """Minutes until the KV cache is full at the recent growth rate (robust slope of the
    engine's KV usage); NaN when it is not growing. 0 when already full: usage at 100%, or
    requests waiting for capacity while the free KV cannot hold one median sequence (prompt +
    output, in whole blocks) to its end (vLLM: usage stays below 100% when the free blocks are
    too few to admit anyone)."""
    from ..plan.forecast import forecast_kv_full

    t, v = w.engine("kv_usage_frac")
    if not len(t):
        return np.nan
    _, waiting = w.engine("requests_waiting_capacity")
    minutes = forecast_kv_full(t, v, window_s=max(w.duration_s, 60.0), waiting=waiting if len(waiting) else None,
                               admit_frac=_admit_frac(w))
    return np.nan if minutes is None else minutes


def _admit_frac(w) -> float:
    """Share of the KV cache a median sequence of the window (prompt + output) takes at its end,
    rounded up to whole blocks (NaN when the capacity or the lengths are unknown)."""
    tokens = w.pct("context_tokens", 50)
    block = _config_number(w, "kv_block_size_tokens", "block_size")
    block = 1.0 if np.isnan(block) else block
    return ratio(np.ceil(tokens / block) * block, w.value("kv_capacity_tokens"))
