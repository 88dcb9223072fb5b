"""TensorRT-LLM names → neutral names: ``trtllm-serve`` (``/prometheus/metrics``, prefix
``trtllm_``) and the Triton ``tensorrtllm_backend`` (``nv_trt_llm_*`` with a type label).

Verified: Triton names against triton-inference-server/tensorrtllm_backend ``README.md`` (Triton
Metrics block, copied in tests/data/metrics); trtllm-serve request histograms against
NVIDIA/TensorRT-LLM ``tensorrt_llm/metrics/collector.py`` and its trtllm-serve test
``test_metrics_endpoint`` (asserts ``trtllm_request_success_total``,
``trtllm_e2e_request_latency_seconds``, ``trtllm_time_to_first_token_seconds``,
``trtllm_request_queue_time_seconds``, ``trtllm_kv_cache_hit_rate``,
``trtllm_kv_cache_utilization``). The iteration gauges (``trtllm_num_requests_*``,
``trtllm_kv_cache_{max_blocks,tokens_per_block,used_blocks}``) are as llm-d's router reads them,
not seen in TensorRT-LLM's source here (the 3rd-party spec mapping ``scheduled`` to running is
not followed: see below). Dynamo re-exports with ``trtllm:``; promtext folds that.
``trtllm_time_per_output_token_seconds`` is observed once per request (MetricNames.TPOT), so it
maps to tpot_seconds.
Triton ``request_type="active"`` is the in-flight count (IterationStats numActiveRequests);
``scheduled`` is those scheduled in the last iteration.
"""
from .neutral import EngineTable, Wire


def _t(kind: str) -> tuple[tuple[str, str], ...]:
    return (("kv_cache_block_type", kind),)


def _r(kind: str) -> tuple[tuple[str, str], ...]:
    return (("request_type", kind),)


TABLE = EngineTable(
    name="trtllm",
    title="TensorRT-LLM",
    prefixes=("trtllm_", "nv_trt_llm_"),
    model_labels=("model_name", "model"),
    metrics=(
        # trtllm-serve
        Wire("trtllm_num_requests_running", "requests_running"),
        Wire("trtllm_num_requests_waiting", "requests_waiting"),
        Wire("trtllm_kv_cache_utilization", "kv_usage_frac"),
        Wire("trtllm_kv_cache_used_blocks", "kv_used_blocks"),
        Wire("trtllm_kv_cache_hit_rate", "prefix_cache_hit_rate"),
        Wire("trtllm_request_success_total", "request_aborted_total", labels=(("finished_reason", "abort"),)),
        Wire("trtllm_request_success_total", "request_success_total"),
        Wire("trtllm_time_to_first_token_seconds", "ttft_seconds"),
        Wire("trtllm_time_per_output_token_seconds", "tpot_seconds"),
        Wire("trtllm_e2e_request_latency_seconds", "e2e_seconds"),
        Wire("trtllm_request_queue_time_seconds", "queue_seconds"),
        Wire("trtllm_kv_cache_max_blocks", "config:kv_num_gpu_blocks"),
        Wire("trtllm_kv_cache_tokens_per_block", "config:kv_block_size_tokens"),
        # Triton tensorrtllm_backend
        Wire("nv_trt_llm_request_metrics", "requests_running", labels=_r("active")),
        Wire("nv_trt_llm_request_metrics", "requests_waiting", labels=_r("waiting")),
        Wire("nv_trt_llm_request_metrics", "config:max_running_requests", labels=_r("max")),
        Wire("nv_trt_llm_kv_cache_block_metrics", "kv_usage_frac", labels=_t("fraction")),
        Wire("nv_trt_llm_kv_cache_block_metrics", "kv_used_blocks", labels=_t("used")),
        Wire("nv_trt_llm_kv_cache_block_metrics", "config:kv_num_gpu_blocks", labels=_t("max")),
        Wire("nv_trt_llm_kv_cache_block_metrics", "config:kv_block_size_tokens", labels=_t("tokens_per")),
    ),
    sources=(
        "triton-inference-server/tensorrtllm_backend README.md (Triton Metrics)",
        "NVIDIA/TensorRT-LLM tensorrt_llm/metrics/collector.py",
        "NVIDIA/TensorRT-LLM trtllm-serve test_metrics_endpoint (prometheus test)",
        "llm-d router engine specs (trtllm-serve iteration gauges; unverified upstream)",
    ),
)
