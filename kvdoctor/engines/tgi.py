"""Text Generation Inference (TGI) Prometheus names → neutral names.

Verified against huggingface/text-generation-inference ``router/src/server.rs``,
``router/src/infer/mod.rs``, ``backends/v3/src/{backend,queue,lib}.rs`` and
``docs/source/reference/metrics.md`` (snapshot of 2026-01). TGI exports through the Rust
``metrics-exporter-prometheus`` crate: counters carry no ``_total`` suffix on older exporter
versions and one on newer; both spellings match. No TTFT histogram exists (derive it from
queue + prefill) and no KV usage gauge; ``tgi_batch_max_total_tokens`` is the token budget
(KV capacity) the v3 backend computed at start.
"""
from .neutral import EngineTable, Wire

TABLE = EngineTable(
    name="tgi",
    title="TGI",
    prefixes=("tgi_",),
    metrics=(
        Wire("tgi_batch_current_size", "requests_running"),
        Wire("tgi_queue_size", "requests_waiting"),
        Wire("tgi_batch_max_total_tokens", "kv_capacity_tokens", note="v3 backend"),
        Wire("tgi_request_count", "requests_total"),
        Wire("tgi_request_success", "request_success_total"),
        Wire("tgi_request_failure", "request_failure_total", note="all err labels summed"),
        Wire("tgi_request_duration", "e2e_seconds"),
        Wire("tgi_request_queue_duration", "queue_seconds"),
        Wire("tgi_request_inference_duration", "inference_seconds"),
        Wire("tgi_request_mean_time_per_token_duration", "tpot_seconds", note="per-request mean"),
        Wire("tgi_request_input_length", "prompt_tokens_per_request"),
        Wire("tgi_request_generated_tokens", "generation_tokens_per_request"),
        Wire("tgi_batch_forward_duration", "step_prefill_seconds", labels=(("method", "prefill"),)),
        Wire("tgi_batch_forward_duration", "step_decode_seconds", labels=(("method", "decode"),)),
    ),
    sources=(
        "huggingface/text-generation-inference router/src/server.rs",
        "huggingface/text-generation-inference backends/v3/src/backend.rs, queue.rs, lib.rs",
        "huggingface/text-generation-inference docs/source/reference/metrics.md",
    ),
)
