"""Engine-neutral metric names, the table types every engine module fills, and derivations.

An ``EngineSample`` carries values under the names in :data:`NEUTRAL`; each engine module
(``vllm.py``, ``sglang.py``, ...) maps its wire names onto them with a :class:`Wire` table.

Aggregation over label sets of one scrape (``agg``): counts, tokens, bytes and counters are
summed (several ``model_name``/``engine``/GPU series of one server add up); fractions are
averaged (the mean KV usage of data-parallel engines, the mean utilisation of the GPUs).

Histograms are stored as ``{"le": [finite upper bounds, ascending], "cum": [cumulative counts],
"sum": seconds or None, "count": observations or None}``; the ``+Inf`` bucket is ``count``
(JSON has no infinity). ``count`` is None when the scrape carried neither ``+Inf`` nor ``_count``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Neutral:
    name: str
    #: gauge | counter | histogram
    kind: str
    unit: str
    #: how label sets of one scrape combine: sum | mean
    agg: str
    doc: str


@dataclass(frozen=True, slots=True)
class Wire:
    """One wire name (any version) → one neutral name. ``neutral`` may be ``config:<key>`` for
    gauges that carry configuration. ``labels`` restricts the entry to samples with those label
    values; the first matching entry of a wire name wins, so put selective entries first."""

    wire: str
    neutral: str
    scale: float = 1.0
    labels: tuple[tuple[str, str], ...] = ()
    note: str = ""


@dataclass(frozen=True, slots=True)
class Info:
    """An info-style gauge (value 1) whose labels carry configuration: label → config key."""

    wire: str
    labels: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class EngineTable:
    name: str
    title: str
    #: metric name prefixes that identify the engine
    prefixes: tuple[str, ...]
    metrics: tuple[Wire, ...]
    info: tuple[Info, ...] = ()
    #: labels that carry the served model's name
    model_labels: tuple[str, ...] = ()
    #: when any of these wire names is present the scrape is from an older version, and
    #: ``legacy`` entries take precedence over ``metrics`` for the same wire name
    legacy_markers: tuple[str, ...] = ()
    legacy: tuple[Wire, ...] = ()
    sources: tuple[str, ...] = ()


_N = [
    # scheduler state
    ("requests_running", "gauge", "requests", "sum", "requests in the running batch"),
    ("requests_waiting", "gauge", "requests", "sum", "requests queued, not yet scheduled"),
    ("requests_swapped", "gauge", "requests", "sum", "requests swapped to CPU (vLLM v0)"),
    ("requests_deferred", "gauge", "requests", "sum",
     "requests deferred for lack of a free slot (llama.cpp); copied to requests_waiting"),
    ("requests_retracted", "gauge", "requests", "sum",
     "requests retracted (preempted) at the latest scheduler step (SGLang gauge)"),
    ("requests_waiting_capacity", "gauge", "requests", "sum",
     "requests waiting for scheduling capacity: a batch slot or KV blocks (vLLM, moves at once on preemption)"),
    # KV cache
    ("kv_usage_frac", "gauge", "fraction", "mean", "KV cache in use, 0..1 (percentages converted)"),
    ("kv_used_tokens", "gauge", "tokens", "sum", "KV cache slots in use, in tokens"),
    ("kv_used_blocks", "gauge", "blocks", "sum", "KV cache blocks in use"),
    ("kv_capacity_tokens", "gauge", "tokens", "sum",
     "KV cache capacity in tokens (configuration; also copied into the config dict)"),
    ("prefix_cache_hit_rate", "gauge", "fraction", "mean",
     "prefix cache hit ratio as the engine reports it (SGLang, TensorRT-LLM, vLLM v0)"),
    # counters (running totals)
    ("preemptions_total", "counter", "requests", "sum", "requests preempted or retracted"),
    ("prompt_tokens_total", "counter", "tokens", "sum", "prompt tokens processed"),
    ("generation_tokens_total", "counter", "tokens", "sum", "tokens generated"),
    ("cached_prompt_tokens_total", "counter", "tokens", "sum", "prompt tokens served from the prefix cache"),
    ("prefix_cache_queries_total", "counter", "tokens", "sum", "tokens looked up in the prefix cache"),
    ("prefix_cache_hits_total", "counter", "tokens", "sum", "tokens found in the prefix cache"),
    ("requests_total", "counter", "requests", "sum", "requests received"),
    ("request_success_total", "counter", "requests", "sum", "requests finished normally (stop, length)"),
    ("request_failure_total", "counter", "requests", "sum", "requests that failed (errors, validation, overload)"),
    ("request_aborted_total", "counter", "requests", "sum", "requests aborted (client gone, cancelled)"),
    ("prompt_seconds_total", "counter", "seconds", "sum", "time spent on prompt processing (llama.cpp)"),
    ("decode_seconds_total", "counter", "seconds", "sum", "time spent generating tokens (llama.cpp)"),
    ("engine_steps_total", "counter", "steps", "sum", "engine forward calls (llama.cpp llama_decode)"),
    ("requests_rejected_total", "counter", "requests", "sum", "requests refused at admission by a queue limit"),
    ("read_bytes_total", "counter", "bytes", "sum", "bytes read from accelerator memory (the engine's estimate)"),
    ("flops_total", "counter", "flops", "sum", "floating point operations (the engine's estimate)"),
    # throughput gauges the engine computes itself
    ("prompt_throughput_tokens_per_s", "gauge", "tokens/s", "sum", "prompt throughput the engine reports"),
    ("gen_throughput_tokens_per_s", "gauge", "tokens/s", "sum", "generation throughput the engine reports"),
    # per-request histograms
    ("ttft_seconds", "histogram", "seconds", "sum", "time to first token"),
    ("itl_seconds", "histogram", "seconds", "sum", "inter-token latency, one observation per token gap"),
    ("tpot_seconds", "histogram", "seconds", "sum", "time per output token, one observation per request"),
    ("e2e_seconds", "histogram", "seconds", "sum", "end-to-end request latency"),
    ("queue_seconds", "histogram", "seconds", "sum", "time in the waiting queue"),
    ("prefill_seconds", "histogram", "seconds", "sum", "time in the prefill phase, per request"),
    ("decode_seconds", "histogram", "seconds", "sum", "time in the decode phase, per request"),
    ("inference_seconds", "histogram", "seconds", "sum", "time running (prefill + decode), per request"),
    ("prompt_tokens_per_request", "histogram", "tokens", "sum", "prompt length per request"),
    ("generation_tokens_per_request", "histogram", "tokens", "sum", "output length per request"),
    ("step_prefill_seconds", "histogram", "seconds", "sum", "one prefill forward pass of a batch (TGI)"),
    ("step_decode_seconds", "histogram", "seconds", "sum", "one decode forward pass of a batch (TGI)"),
    # GPU (DCGM exporter)
    ("gpu_mem_used_bytes", "gauge", "bytes", "sum", "GPU framebuffer used"),
    ("gpu_mem_free_bytes", "gauge", "bytes", "sum", "GPU framebuffer free"),
    ("gpu_mem_total_bytes", "gauge", "bytes", "sum", "GPU framebuffer total"),
    ("gpu_util_frac", "gauge", "fraction", "mean", "share of time a kernel ran (DCGM_FI_DEV_GPU_UTIL)"),
    ("gpu_mem_copy_util_frac", "gauge", "fraction", "mean", "share of time memory was read or written"),
    ("gpu_dram_active_frac", "gauge", "fraction", "mean", "DRAM interface active cycles / elapsed (DCP)"),
    ("gpu_gr_engine_active_frac", "gauge", "fraction", "mean", "graphics engine active time (DCP)"),
    ("gpu_sm_active_frac", "gauge", "fraction", "mean", "SM cycles with a warp resident (DCP)"),
    ("gpu_tensor_active_frac", "gauge", "fraction", "mean", "tensor pipe active cycles (DCP)"),
    ("gpu_power_w", "gauge", "watts", "sum", "board power draw"),
]

#: neutral name → definition
NEUTRAL: dict[str, Neutral] = {n[0]: Neutral(*n) for n in _N}

#: keys of the config dict parse_scrape returns (engines may add raw ones under ``raw``)
CONFIG_KEYS: dict[str, str] = {
    "model": "served model name",
    "gpu_name": "GPU product name (DCGM modelName label)",
    "kv_block_size_tokens": "tokens per KV block/page",
    "kv_num_gpu_blocks": "KV blocks/pages on the GPU",
    "kv_num_cpu_blocks": "KV blocks in CPU swap space (vLLM v0)",
    "kv_capacity_tokens": "KV capacity in tokens (blocks × block size, or as reported)",
    "kv_cache_dtype": "KV cache data type (auto = model dtype)",
    "kv_cache_bytes": "memory given to the KV cache",
    "prefix_caching": "prefix caching enabled",
    "gpu_memory_utilization_frac": "share of GPU memory the engine may take",
    "max_running_requests": "most requests in one batch (max-num-seqs, slots)",
    "max_prefill_tokens": "most prompt tokens per prefill batch",
    "context_len_tokens": "context length per request",
    "sliding_window_tokens": "sliding attention window",
    "chunked_prefill": "chunked prefill enabled",
    "max_batched_tokens": "tokens per engine step (vLLM max-num-batched-tokens, SGLang chunked-prefill-size)",
    "max_input_tokens": "longest prompt accepted (TGI)",
    "declared": "what the user declared (attach --engine-config), key -> value, also merged into the config",
    "command_line": "settings read from the server process's command line (engines/cmdline.py), setting -> value",
}


def derive(values: dict[str, float], config: dict) -> None:
    """Fill neutral values that follow from others or from config; given values win."""
    cap = values.get("kv_capacity_tokens", config.get("kv_capacity_tokens"))
    if cap is None:
        bs, nb = config.get("kv_block_size_tokens"), config.get("kv_num_gpu_blocks")
        if isinstance(bs, (int, float)) and isinstance(nb, (int, float)) and bs > 0 and nb > 0:
            cap = float(bs * nb)
    if cap is not None and cap > 0:
        values.setdefault("kv_capacity_tokens", float(cap))
        config.setdefault("kv_capacity_tokens", int(cap) if float(cap).is_integer() else cap)
    bs = config.get("kv_block_size_tokens")
    if "kv_used_tokens" not in values and "kv_used_blocks" in values and isinstance(bs, (int, float)):
        values["kv_used_tokens"] = values["kv_used_blocks"] * bs
    if cap:
        if "kv_usage_frac" not in values and "kv_used_tokens" in values:
            values["kv_usage_frac"] = values["kv_used_tokens"] / cap
        if "kv_used_tokens" not in values and "kv_usage_frac" in values:
            values["kv_used_tokens"] = values["kv_usage_frac"] * cap
    if "requests_waiting" not in values and "requests_deferred" in values:
        values["requests_waiting"] = values["requests_deferred"]
