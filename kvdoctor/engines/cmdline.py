"""Settings from the server process's command line, for the flags an engine does not report.

vLLM 0.32's /metrics carries the cache config but no scheduler config (``--max-num-seqs``,
``--max-num-batched-tokens``, ``--no-enable-chunked-prefill``), and llama.cpp's /props no batch
sizes (``-b``, ``-ub``) or KV types: when ``kvdoctor attach`` runs on the server's host it can
read them from the process's arguments. Only the flags below are read, as neutral settings; the
rest of the command line (which may hold an ``--api-key``) is never kept.

Flag names as the engines define them: vllm 0.32.0 vllm/engine/arg_utils.py (argparse with
``--flag``/``--no-flag`` booleans, ``_`` and ``-`` interchangeable); llama.cpp b11434
``llama-server --help``; sglang 0.5.23 sglang/srt/arg_groups/fields; TGI launcher/src/main.rs
@db931fcf (clap, kebab case); TensorRT-LLM tensorrt_llm/commands/serve.py @00209af1 (click,
snake case).
"""
from __future__ import annotations

from typing import Any, Sequence

#: a flag's reading: (setting, int | str | True | False); True/False: the flag alone sets that value
Reading = tuple[str, Any]

#: engine -> flag (dashes) -> reading
FLAGS: dict[str, dict[str, Reading]] = {
    "vllm": {
        "--max-num-seqs": ("max_running_requests", int),
        "--max-num-batched-tokens": ("max_batched_tokens", int),
        "--enable-chunked-prefill": ("chunked_prefill", True),
        "--no-enable-chunked-prefill": ("chunked_prefill", False),
        "--enable-prefix-caching": ("prefix_caching", True),
        "--no-enable-prefix-caching": ("prefix_caching", False),
        "--max-model-len": ("context_len_tokens", int),
        "--kv-cache-dtype": ("kv_cache_dtype", str),
    },
    "sglang": {
        "--max-running-requests": ("max_running_requests", int),
        "--chunked-prefill-size": ("max_batched_tokens", int),
        "--disable-radix-cache": ("prefix_caching", False),
        "--context-length": ("context_len_tokens", int),
        "--kv-cache-dtype": ("kv_cache_dtype", str),
    },
    "tgi": {
        "--max-batch-prefill-tokens": ("max_batched_tokens", int),
        "--max-total-tokens": ("context_len_tokens", int),
        "--kv-cache-dtype": ("kv_cache_dtype", str),
    },
    "llamacpp": {
        "-b": ("max_batched_tokens", int), "--batch-size": ("max_batched_tokens", int),
        "-ub": ("ubatch_tokens", int), "--ubatch-size": ("ubatch_tokens", int),
        "--cache-reuse": ("cache_reuse_tokens", int),
        "-np": ("max_running_requests", int), "--parallel": ("max_running_requests", int),
        "-ctk": ("cache_type_k", str), "--cache-type-k": ("cache_type_k", str),
        "-ctv": ("cache_type_v", str), "--cache-type-v": ("cache_type_v", str),
        "--cache-prompt": ("cache_prompt", True), "--no-cache-prompt": ("cache_prompt", False),
    },
    "trtllm": {
        "--max-batch-size": ("max_running_requests", int),
        "--max-num-tokens": ("max_batched_tokens", int),
        "--max-seq-len": ("context_len_tokens", int),
        "--enable-chunked-prefill": ("chunked_prefill", True),
    },
}


def _flag(token: str, engine: str) -> str:
    """``--max_num_seqs`` and ``--max-num-seqs`` alike (vLLM, SGLang and trtllm-serve accept or
    use underscores); llama.cpp's short flags stay as they are."""
    return token if engine == "llamacpp" and not token.startswith("--") else "--" + token[2:].replace("_", "-")


def config_from_cmdline(engine: str | None, argv: Sequence[str] | None) -> dict[str, Any]:
    """Neutral settings (and llama.cpp's ``cache_type_k``/``cache_type_v``) set on ``argv``; the
    last occurrence of a flag wins, as in argparse. Values that do not parse are left out."""
    table = FLAGS.get(engine or "")
    if not table or not argv:
        return {}
    out: dict[str, Any] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("-"):
            continue
        name, eq, inline = token.partition("=")
        reading = table.get(_flag(name, engine))
        if reading is None:
            continue
        setting, kind = reading
        if kind is True or kind is False:
            out[setting] = kind
            continue
        if eq:
            raw = inline
        elif i < len(args):
            raw, i = args[i], i + 1
        else:
            continue
        try:
            out[setting] = int(raw) if kind is int else str(raw)
        except ValueError:
            continue
    return out
