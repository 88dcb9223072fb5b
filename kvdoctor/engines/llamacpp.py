"""llama.cpp ``llama-server --metrics`` names → neutral names, and config from ``/props`` + ``/slots``.

Verified against ggml-org/llama.cpp ``tools/server/server-context.cpp`` (the ``get_metrics``
route; 2025-12) and the older ``examples/server/server.cpp`` (which also exported
``kv_cache_usage_ratio`` and ``kv_cache_tokens``, removed since). The server writes every name
with its ``# TYPE`` line, e.g. ``llamacpp:prompt_tokens_total counter``; the seconds counters
are seconds (milliseconds / 1e3). ``prompt_tokens_cached_total`` appears only in newer builds.
llama.cpp has no latency histograms: per-response ``timings`` carry them instead.
"""
from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any

from .neutral import EngineTable, Wire

TABLE = EngineTable(
    name="llamacpp",
    title="llama.cpp",
    prefixes=("llamacpp:",),
    metrics=(
        Wire("llamacpp:requests_processing", "requests_running"),
        Wire("llamacpp:requests_deferred", "requests_deferred"),
        Wire("llamacpp:kv_cache_usage_ratio", "kv_usage_frac", note="old builds"),
        Wire("llamacpp:kv_cache_tokens", "kv_used_tokens", note="old builds"),
        Wire("llamacpp:prompt_tokens_total", "prompt_tokens_total"),
        Wire("llamacpp:tokens_predicted_total", "generation_tokens_total"),
        Wire("llamacpp:prompt_tokens_cached_total", "cached_prompt_tokens_total", note="newer builds"),
        Wire("llamacpp:prompt_seconds_total", "prompt_seconds_total"),
        Wire("llamacpp:tokens_predicted_seconds_total", "decode_seconds_total"),
        Wire("llamacpp:n_decode_total", "engine_steps_total"),
        Wire("llamacpp:prompt_tokens_seconds", "prompt_throughput_tokens_per_s"),
        Wire("llamacpp:predicted_tokens_seconds", "gen_throughput_tokens_per_s"),
    ),
    sources=(
        "ggml-org/llama.cpp tools/server/server-context.cpp (get_metrics, get_props, get_slots)",
        "ggerganov/llama.cpp examples/server/server.cpp (older names)",
    ),
)


def llamacpp_config_from_props(props: dict[str, Any] | None, slots: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Config from ``GET /props`` and ``GET /slots``.

    Gives ``n_ctx`` (per slot), ``total_slots`` and ``parallel`` (``--parallel``), ``model``
    (alias, else the model file's name), ``slot_n_ctx`` (list, one per slot) and the neutral
    keys ``context_len_tokens`` and ``max_running_requests``. Missing fields are left out.
    """
    props = props or {}
    out: dict[str, Any] = {}
    dgs = props.get("default_generation_settings") or {}
    n_ctx = dgs.get("n_ctx", props.get("n_ctx"))
    slot_ctx = [s.get("n_ctx") for s in (slots or []) if isinstance(s, dict) and s.get("n_ctx") is not None]
    if n_ctx is None and slot_ctx:
        n_ctx = max(slot_ctx)
    if n_ctx is not None:
        out["n_ctx"] = out["context_len_tokens"] = int(n_ctx)
    total = props.get("total_slots")
    if total is None and slots:
        total = len(slots)
    if total is not None:
        out["total_slots"] = out["parallel"] = out["max_running_requests"] = int(total)
    model = llamacpp_model_name(props)
    if model:
        out["model"] = model
    if slot_ctx:
        out["slot_n_ctx"] = [int(c) for c in slot_ctx]
    return out


def llamacpp_model_name(props: dict[str, Any] | None) -> str | None:
    """The served model's name from ``/props``: ``model_alias`` (``--alias``), unless it is the
    model's path (what llama-server reports without ``--alias``), then the file's name: a
    capture names the model, not the directory layout of the machine it was served from."""
    props = props or {}
    path = str(props.get("model_path") or "")
    alias = str(props.get("model_alias") or "")
    name = alias if alias and alias != path else path
    return PurePath(name.replace("\\", "/")).name if name == path and path else (name or None)


_BUILD = re.compile(r"\bb(\d+)\b")


def llamacpp_version(props: dict[str, Any] | None) -> str | None:
    """The build from ``/props`` ``build_info`` ("b11434-<commit>" -> "b11434"), None when absent
    (older builds do not report it)."""
    info = str((props or {}).get("build_info") or "")
    m = _BUILD.search(info)
    return f"b{m.group(1)}" if m else (info or None)
