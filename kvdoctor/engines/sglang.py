"""SGLang (``--enable-metrics``) Prometheus names → neutral names.

Verified against sgl-project/sglang ``python/sglang/srt/metrics/collector.py`` (2025 and 2026
versions) and the early ``python/sglang/srt/metrics/metrics_collector.py`` (late 2024: label
``name``, ``num_requests_running``/``num_requests_waiting``, per-batch ``cached_token`` gauge,
``cache_hit_rate`` in percent, ``max_total_num_tokens``/``context_len`` config gauges).
Renames: ``time_per_output_token_seconds`` → ``inter_token_latency_seconds`` (both observe
token gaps), ``waiting_request_latency_seconds`` → ``queue_time_seconds``,
``request_prompt_tokens`` → ``prompt_tokens_histogram``.
The SGLang router and Ray re-exports write ``sglang_`` for ``sglang:``; promtext folds that.
"""
from .neutral import EngineTable, Info, Wire

TABLE = EngineTable(
    name="sglang",
    title="SGLang",
    prefixes=("sglang:",),
    model_labels=("model_name", "name"),
    metrics=(
        Wire("sglang:num_running_reqs", "requests_running"),
        Wire("sglang:num_requests_running", "requests_running", note="early"),
        Wire("sglang:num_queue_reqs", "requests_waiting"),
        Wire("sglang:num_requests_waiting", "requests_waiting", note="early"),
        Wire("sglang:queue_req", "requests_waiting", note="early, per prefill batch"),
        Wire("sglang:token_usage", "kv_usage_frac", note="0..1"),
        Wire("sglang:kv_used_tokens", "kv_used_tokens", note="2026"),
        Wire("sglang:num_used_tokens", "kv_used_tokens"),
        Wire("sglang:max_total_num_tokens", "kv_capacity_tokens"),
        Wire("sglang:cache_hit_rate", "prefix_cache_hit_rate", note="a ratio; percent in early versions"),
        Wire("sglang:num_retracted_reqs", "requests_retracted"),
        Wire("sglang:num_retracted_requests_total", "preemptions_total", note="2026"),
        Wire("sglang:prompt_tokens_total", "prompt_tokens_total"),
        Wire("sglang:generation_tokens_total", "generation_tokens_total"),
        Wire("sglang:cached_tokens_total", "cached_prompt_tokens_total"),
        Wire("sglang:num_requests_total", "requests_total"),
        Wire("sglang:num_aborted_requests_total", "request_aborted_total"),
        Wire("sglang:gen_throughput", "gen_throughput_tokens_per_s"),
        Wire("sglang:time_to_first_token_seconds", "ttft_seconds"),
        Wire("sglang:inter_token_latency_seconds", "itl_seconds"),
        Wire("sglang:time_per_output_token_seconds", "itl_seconds", note="old name of inter_token_latency"),
        Wire("sglang:e2e_request_latency_seconds", "e2e_seconds"),
        Wire("sglang:queue_time_seconds", "queue_seconds"),
        Wire("sglang:waiting_request_latency_seconds", "queue_seconds", note="early"),
        Wire("sglang:prompt_tokens_histogram", "prompt_tokens_per_request"),
        Wire("sglang:request_prompt_tokens", "prompt_tokens_per_request", note="early"),
        Wire("sglang:generation_tokens_histogram", "generation_tokens_per_request"),
        Wire("sglang:request_generation_tokens", "generation_tokens_per_request", note="early"),
        Wire("sglang:request_success_total", "request_success_total", note="early"),
        Wire("sglang:context_len", "config:context_len_tokens"),
        Wire("sglang:max_running_requests", "config:max_running_requests"),
        Wire("sglang:max_prefill_tokens", "config:max_prefill_tokens"),
        Wire("sglang:page_size", "config:kv_block_size_tokens"),
        Wire("sglang:num_pages", "config:kv_num_gpu_blocks"),
    ),
    info=(
        Info("sglang:cache_config_info", (
            ("page_size", "kv_block_size_tokens"),
            ("num_pages", "kv_num_gpu_blocks"),
        )),
    ),
    # the early collector reported cache_hit_rate in percent (console: "cache hit rate: x%")
    legacy_markers=("sglang:num_requests_running", "sglang:queue_req", "sglang:new_seq", "sglang:cached_token"),
    legacy=(Wire("sglang:cache_hit_rate", "prefix_cache_hit_rate", scale=0.01, note="early: percent"),),
    sources=(
        "sgl-project/sglang python/sglang/srt/metrics/collector.py",
        "sgl-project/sglang python/sglang/srt/metrics/metrics_collector.py (early)",
        "sgl-project/sglang docs/references/production_metrics.md",
    ),
)
