"""Decode physics: what memory bandwidth allows a decode step, and what else stalls it.

A decode step reads every weight once and the KV cache of every sequence in the batch, so
its time is at least (weights + batch x context x KV bytes per token) / peak bandwidth. A TPOT
near that bound (within a few times: kernels reach 50-80% of peak) is bandwidth-bound; a TPOT
far above it is something else (prefills sharing the step, preemption, a CPU-bound server).
"""
from __future__ import annotations

import numpy as np

from .registry import FIT_MIN_X_SPREAD_FRAC, fit, percentile, signal

#: share of GPU memory an engine gives weights + KV (vLLM's default gpu_memory_utilization)
GPU_MEM_UTIL_FRAC = 0.9


def _hardware(prep):
    """(weight bytes, KV bytes per token, peak bandwidth, GPU memory) from the capture's
    model and GPU names and the plan tables; None when either is unknown. Once per capture."""
    return prep.memoised("decode_hardware", lambda: _hardware_of(prep))


def _hardware_of(prep):
    from ..errors import InputError
    from ..plan import kvmodel as km
    from ..plan.models import builtin_model, gpu_bandwidth
    from ..plan.planner import weight_bytes

    out = None
    cfg = prep.config
    gpu_name = prep.meta.gpu or cfg.get("gpu") or cfg.get("gpu_name")
    if not gpu_name and len(prep.cap.gpu):  # NVML samples carry the product name
        gpu_name = next((n for n in prep.cap.gpu.strings("name") if n), None)
    model_name = prep.meta.model or cfg.get("model")
    if gpu_name and model_name:
        try:
            spec = builtin_model(str(model_name))
            hw = gpu_bandwidth(str(gpu_name))
            dtype = km.kv_dtype(str(cfg.get("kv_cache_dtype") or "auto"))
            tp = int(cfg.get("tensor_parallel_size") or 1)
            if hw:
                out = (weight_bytes(spec) / tp, km.kv_bytes_per_token(spec, dtype, tp), hw[2], hw[1])
        except (InputError, ValueError, TypeError):
            out = None
    return out


def _bound_per_request(w) -> np.ndarray:
    """Each request's bandwidth-bound TPOT: weights + the KV of the batch it decoded in (its
    mean in-flight count, capped by what the KV budget holds; other sequences' contexts taken
    as long as its own) over peak bandwidth."""
    hw = _hardware(w.prep)
    if hw is None:
        return np.full(w.n_requests, np.nan)
    weights, kv_tok, bw, mem = hw
    ctx = w.r("prompt_tokens") + np.nan_to_num(w.r("output_tokens")) / 2
    seq_bytes = ctx * kv_tok
    with np.errstate(all="ignore"):
        fits = np.maximum((mem * GPU_MEM_UTIL_FRAC - weights) / seq_bytes, 1.0)
    batch = np.minimum(np.maximum(w.r("decode_concurrency"), 1.0), fits)
    return (weights + batch * seq_bytes) / bw


@signal("decode_bw_bound_tpot_s", "s")
def bw_bound(w):
    """Median over requests of the TPOT memory bandwidth alone would give (estimate from the
    model and GPU tables: weights + batch KV / peak bandwidth); NaN when model or GPU unknown."""
    return percentile(_bound_per_request(w), 50)


@signal("tpot_over_bw_bound_p50", "ratio")
def tpot_over_bound(w):
    """Median over requests of TPOT / its bandwidth-bound TPOT. 1-3: decode runs near what
    bandwidth allows; far above: bandwidth does not explain the TPOT."""
    return percentile(w.r("tpot_s") / _bound_per_request(w), 50, 5)


@signal("decode_bw_known", "bool")
def bw_known(w):
    """1 when memory bandwidth is measured (NVML/DCGM) or estimable (model and GPU known),
    else 0: a bandwidth verdict without either is a hypothesis."""
    measured = np.isfinite(w.value("mem_bw_util_p90"))
    return float(measured or _hardware(w.prep) is not None)


@signal("gpu_seen", "bool")
def gpu_seen(w):
    """1 when the capture names or samples a GPU; 0 when it has host samples from the server
    but no GPU at all (a CPU server such as llama.cpp without offload); NaN otherwise."""
    prep = w.prep
    if len(prep.gpu) or prep.meta.gpu or prep.config.get("gpu_name") or prep.config.get("gpu"):
        return 1.0
    return 0.0 if len(prep.cap.host) else np.nan


@signal("tpot_prefill_interference_corr", "rank corr")
def prefill_interference(w):
    """Rank correlation of a request's TPOT with the prompt tokens other requests brought in
    while it decoded, per token it generated: prefills sharing (or taking over) decode steps
    stretch exactly the requests that overlap them."""
    key = "prefill_interference"
    if key not in w._cache:
        prompt_cum = _prompt_tokens_arrived(w.prep)
        first, fin = w.r("first_token_s"), w.r("finish_s")
        out_tok = w.r("output_tokens")
        ok = np.isfinite(first) & np.isfinite(fin) & (out_tok > 1)
        x = np.full(w.n_requests, np.nan)
        if ok.any() and prompt_cum is not None:
            t = w.prep.t
            lo = np.searchsorted(t, first[ok], side="right")
            hi = np.searchsorted(t, fin[ok], side="right")
            x[ok] = (prompt_cum[hi] - prompt_cum[lo]) / (out_tok[ok] - 1)
        w._cache[key] = fit(x, w.r("tpot_s"), min_spread_frac=FIT_MIN_X_SPREAD_FRAC)
    return w._cache[key][1]


def _prompt_tokens_arrived(prep) -> np.ndarray | None:
    """Prompt tokens of the requests that arrived before each one (a prefix sum in arrival order,
    with a leading 0), once per capture; None when the arrival times are not in order."""
    def build():
        t = prep.t
        if not np.all(np.diff(t[np.isfinite(t)]) >= 0):
            return None
        return np.concatenate([[0.0], np.cumsum(np.nan_to_num(prep.col["prompt_tokens"]))])

    return prep.memoised("prompt_tokens_arrived", build)
