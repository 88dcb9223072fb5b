"""Signals as people read them: "TTFT P99 5.31 s", "0.94 req/s", not ``ttft_p99_s = 5.31 s``.

One table, label per signal; the value's format comes from the signal's unit (units.fmt). The identifiers
stay in JSON and in ``--verbose`` text (a test checks every registered signal has a label here).
"""
from __future__ import annotations

from ..signals import REGISTRY
from ..units import fmt

#: signal -> label, read before its value ("TTFT P99" 5.31 s)
LABELS: dict[str, str] = {
    # latency percentiles and tails
    **{f"{p}_p{q}_s": f"{lbl} P{q}" for p, lbl in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E latency"),
                                                   ("queue", "queue time")) for q in (50, 90, 99)},
    **{f"{p}_p{a}_over_p50": f"{lbl} P{a}/P50" for p, lbl in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E"),
                                                              ("queue", "queue time")) for a in (90, 99)},
    "itl_p50_s": "inter-token gap P50", "itl_p90_s": "inter-token gap P90", "itl_p99_s": "inter-token gap P99", "itl_p99_over_p50": "inter-token gap P99/P50",
    # objectives and harm
    "ttft_breach": "TTFT objective broken", "tpot_breach": "decode objective broken",
    "e2e_breach": "E2E objective broken", "error_rate_breach": "error-rate objective broken",
    "objective_breached": "an objective broken", "objective_defaults_only": "only default objectives broken",
    "ttft_burn_rate": "TTFT budget burn", "tpot_burn_rate": "decode budget burn", "e2e_burn_rate": "E2E budget burn",
    "error_rate_burn_rate": "error budget burn",
    "ttft_over_objective": "TTFT over objective", "tpot_over_objective": "decode over objective",
    "e2e_over_objective": "E2E over objective", "error_rate_over_objective": "error rate over objective",
    "latency_over_objective": "worst latency over objective",
    "ttft_harm": "first tokens hurt users", "tpot_harm": "decoding hurts users", "latency_harm": "latency hurts users",
    "ttft_wait_p90_s": "wait beyond own prefill P90", "ttft_unloaded_p90_s": "unloaded TTFT P90",
    "engine_wait_over_work": "engine queue over running batch",
    "ttft_slow_wait_share": "slow requests' time waiting", "ttft_slow_prefill_frac": "slow requests with prefill over target",
    # load and baseline
    "requests": "requests", "request_rate_per_s": "arrival rate", "output_tokens_per_s": "output",
    "concurrency_p50": "in flight P50", "concurrency_max": "in flight max", "low_load_in_flight": "in flight at low load",
    "ttft_low_load_p50_s": "TTFT at low load", "tpot_low_load_p50_s": "TPOT at low load",
    "ttft_over_low_load": "TTFT vs low load", "tpot_over_low_load": "TPOT vs low load",
    "inflight_over_littles_law": "in flight vs Little's law", "arrivals_over_completions": "arrivals per completion",
    "ttft_late_over_early": "TTFT late vs early", "queue_share_p50": "share of latency queued",
    "queued_frac": "arrived with every slot busy", "requests_waiting_p50": "engine queue P50",
    "ttft_high_over_low_concurrency": "TTFT high vs low concurrency",
    "tpot_high_over_low_concurrency": "TPOT high vs low concurrency", "load_change_frac": "load change",
    # prompts and prefill
    "prompt_p50_tokens": "prompt P50", "prompt_p95_tokens": "prompt P95", "prompt_p99_tokens": "prompt P99",
    "prompt_p99_over_p50": "prompt P99/P50", "prompt_p99_over_limit": "P99 sequence vs context limit",
    "ttft_prompt_slope_ms_per_1k_tokens": "TTFT per 1k prompt tokens", "ttft_prompt_corr": "TTFT-prompt rank correlation",
    "ttft_long_over_short": "TTFT long vs short prompts", "hol_ttft_ratio": "short TTFT behind a long prefill",
    "prefill_ms_per_1k_tokens_low_load": "prefill at low load", "short_tpot_long_inflight_ratio": "short TPOT beside a long prompt",
    # prefix cache
    "prefix_hit_rate_achieved": "prefix cache hit rate", "prefix_hit_rate_achievable": "reusable prefix share",
    "prefix_hit_gap": "reuse left on the table", "ttft_cache_bimodal": "TTFT splits into hits and misses",
    "ttft_fast_mode_frac": "fast (hit) share", "ttft_fast_mode_p50_s": "hit TTFT", "ttft_slow_mode_p50_s": "miss TTFT",
    "ttft_slow_mode_over_prefill": "miss TTFT vs prefill cost",
    "prefix_reusable_request_frac": "requests with a reusable prefix", "misses_reusable": "misses could have hit",
    "arrivals_known": "send times known",
    "config_prefix_caching": "prefix caching", "config_chunked_prefill": "chunked prefill",
    "config_max_batched_tokens": "tokens per step", "config_ubatch_tokens": "physical batch (-ub)",
    "config_max_running_requests": "concurrency limit (config)", "config_cache_reuse_tokens": "cache reuse (--cache-reuse)",
    "config_cache_prompt": "cache_prompt default",
    # decode
    "tpot_concurrency_corr": "TPOT-concurrency rank correlation", "tpot_context_corr": "TPOT-context rank correlation",
    "tpot_context_slope_ms_per_1k_tokens": "TPOT per 1k context tokens", "decode_bw_bound_tpot_s": "bandwidth-bound TPOT",
    "tpot_over_bw_bound_p50": "TPOT vs bandwidth bound", "decode_bw_known": "bandwidth known", "gpu_seen": "GPU seen",
    "tpot_prefill_interference_corr": "TPOT-prefill overlap rank correlation",
    "itl_prefill_stall_share": "decode time stalled by prefills", "itl_prefill_stall_corr": "stall-prompt rank correlation",
    "itl_prefill_stall_ms_per_1k_tokens": "stall per 1k prefilled tokens",
    "itl_prefill_overlap_over_plain_p50": "step with prefill vs without",
    "itl_long_prefill_overlap_over_plain_p50": "gap during a long prefill vs plain",
    "tpot_p99_without_prefill_stalls_s": "TPOT P99 without the stalls",
    "tpot_breach_without_prefill_stalls": "decode objective broken without the stalls",
    "host_other_cpu_frac": "host CPU taken by others", "mem_bw_util_p50": "memory bandwidth P50",
    "server_run_wait_frac": "server threads waiting for a CPU",
    "mem_bw_util_p90": "memory bandwidth P90",
    # turns
    "turn_max": "deepest turn", "context_tokens_per_turn": "history added per turn", "sessions": "conversations",
    "ttft_growth_per_turn_frac": "TTFT growth", "tpot_growth_per_turn_frac": "decode growth",
    "turn_tpot_corr": "per-turn decode rank correlation", "turn_ttft_corr": "per-turn TTFT rank correlation",
    "turn_tpot_trend_z": "decode trend", "turn_ttft_trend_z": "TTFT trend",
    # errors and outcomes
    "error_rate": "error rate", "errors": "failed requests", "error_rate_max_1m": "worst minute's error rate",
    "context_errors": "context-length refusals", "rate_limited_errors": "rate-limited (429)",
    "kv_exhausted_errors": "out-of-KV failures", "overload_errors": "load shed (503)", "timeout_errors": "timeouts",
    "invalid_request_errors": "invalid requests", "server_failure_errors": "server failures (5xx)",
    "cancelled_requests": "cancelled by client", "client_flagged_requests": "flagged by client",
    "oom_events": "out-of-memory events", "server_restarts": "server restarts or outages",
    # memory and KV
    "kv_usage_max_frac": "KV usage max", "kv_usage_p50_frac": "KV usage P50", "kv_growth_frac_per_min": "KV growth",
    "preemptions_per_min": "preemptions", "kv_full_forecast_min": "KV full in", "kv_capacity_tokens": "KV capacity",
    "max_concurrency_configured": "concurrency limit", "sequence_p99_tokens": "sequence P99",
    "kv_demand_over_capacity": "worst-case KV demand vs capacity", "kv_usage_over_token_demand": "KV usage vs tokens held",
    "kv_dtype_quantised": "KV quantised", "context_limit_tokens": "context limit",
    "gpu_mem_used_max_frac": "GPU memory used max", "gpu_mem_headroom_min_bytes": "GPU memory free min",
    "gpu_mem_growth_mib_per_h": "GPU memory growth", "gpu_mem_growth_corr": "GPU memory growth steadiness",
    "server_rss_growth_mib_per_h": "server memory growth", "server_rss_growth_corr": "server memory growth steadiness",
    # output quality
    "repetition_p50": "output repetition P50", "repetition_long_minus_short": "repetition long vs short context",
    "baseline_compared": "compared with a baseline", "baseline_agreement_long_p50": "agreement with baseline (long)",
    "baseline_agreement_drop": "agreement drop with context", "baseline_repetition_gap_long": "extra repetition (long)",
    "baseline_forced_compared": "teacher-forced against a baseline",
    "baseline_forced_agreement_p50": "same next token as baseline P50",
    "baseline_forced_agreement_long_p50": "same next token as baseline (long)",
    "context_cut_requests": "answers cut at the context limit", "context_cut_frac": "share of answers cut",
}


def label(name: str) -> str:
    return LABELS.get(name, name.replace("_", " "))


def reading(name: str, value: float | None) -> str:
    """'TTFT P99 5.31 s': the label and the value in its unit."""
    return f"{label(name)} {fmt(value, REGISTRY[name].unit)}"
