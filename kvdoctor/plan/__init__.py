"""KV-cache capacity planning: how much KV memory a model needs per token and per sequence,
how many tokens and concurrent requests fit on a GPU, and live forecasts of the cache filling.
See docs/plan.md."""
from .forecast import ConcurrencyCheck, forecast_kv_full, unsafe_concurrency
from .kvmodel import (KV_DTYPES, GpuBudget, KvDtype, ModelSpec, kv_bytes_per_sequence, kv_bytes_per_token,
                      kv_dtype, max_concurrency, max_kv_tokens, safe_concurrency, spec_from_hf_config)
from .models import builtin_model, gpu_memory, resolve_model
from .planner import PlanInputs, plan, render_text

__all__ = [
    "KV_DTYPES", "ConcurrencyCheck", "GpuBudget", "KvDtype", "ModelSpec", "PlanInputs", "builtin_model",
    "forecast_kv_full", "gpu_memory", "kv_bytes_per_sequence", "kv_bytes_per_token", "kv_dtype",
    "max_concurrency", "max_kv_tokens", "plan", "render_text", "resolve_model", "safe_concurrency",
    "spec_from_hf_config", "unsafe_concurrency",
]
