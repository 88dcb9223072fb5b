"""vLLM (v0 engine and v1 engine) Prometheus names → neutral names.

Verified against vllm-project/vllm ``vllm/v1/metrics/loggers.py`` (v0.9–v0.12 era: deprecation
comments give the renames) and the v0 ``vllm/engine/metrics.py`` names as scraped in
vllm-project/aibrix ``docs/source/features/runtime.rst``. Counters are registered without
``_total`` and exposed with it; both spellings match.

Renames: ``gpu_cache_usage_perc`` → ``kv_cache_usage_perc`` (0.9; both a 0..1 fraction despite
the name); ``gpu_prefix_cache_{queries,hits}`` → ``prefix_cache_{queries,hits}`` (0.9);
``time_per_output_token_seconds`` → ``inter_token_latency_seconds`` (0.11: the old histogram
observed every token gap, so it is an ITL, not the per-request TPOT, which is
``request_time_per_output_token_seconds``).
"""
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
        Wire("vllm:num_requests_swapped", "requests_swapped", note="v0"),
        Wire("vllm:kv_cache_usage_perc", "kv_usage_frac", note="v1 ≥0.9; a 0..1 fraction"),
        Wire("vllm:gpu_cache_usage_perc", "kv_usage_frac", note="v0 and v1 <0.12; a 0..1 fraction"),
        Wire("vllm:gpu_prefix_cache_hit_rate", "prefix_cache_hit_rate", note="v0; -1 when off"),
        Wire("vllm:num_preemptions_total", "preemptions_total"),
        Wire("vllm:prompt_tokens_total", "prompt_tokens_total"),
        Wire("vllm:generation_tokens_total", "generation_tokens_total"),
        Wire("vllm:prompt_tokens_cached_total", "cached_prompt_tokens_total", note="v1 newer"),
        Wire("vllm:prefix_cache_queries_total", "prefix_cache_queries_total", note="v1 ≥0.9"),
        Wire("vllm:gpu_prefix_cache_queries_total", "prefix_cache_queries_total", note="v1 <0.12"),
        Wire("vllm:prefix_cache_hits_total", "prefix_cache_hits_total", note="v1 ≥0.9"),
        Wire("vllm:gpu_prefix_cache_hits_total", "prefix_cache_hits_total", note="v1 <0.12"),
        Wire("vllm:request_success_total", "request_aborted_total", labels=_ABORT),
        Wire("vllm:request_success_total", "request_failure_total", labels=_ERROR),
        Wire("vllm:request_success_total", "request_success_total", note="stop, length"),
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
            ("cache_dtype", "kv_cache_dtype"),
            ("enable_prefix_caching", "prefix_caching"),
            ("gpu_memory_utilization", "gpu_memory_utilization_frac"),
            ("sliding_window", "sliding_window_tokens"),
        )),
    ),
    sources=(
        "vllm-project/vllm vllm/v1/metrics/loggers.py",
        "vllm-project/aibrix docs/source/features/runtime.rst (v0 scrape)",
    ),
)
