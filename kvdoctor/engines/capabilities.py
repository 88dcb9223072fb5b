"""Which features an engine has at all, so a fix or ``advise`` never offers one it lacks (llama.cpp
and TGI cannot split prefill and decode across instances; vLLM, SGLang and TensorRT-LLM can).

Whether a feature an engine has is *on* is a setting: :func:`kvdoctor.engines.defaults.effective_config`.
Each entry says how the engine does it and where that was checked.
"""
from __future__ import annotations

from dataclasses import dataclass

from .labels import ENGINE_KNOB


@dataclass(frozen=True, slots=True)
class Capability:
    has: bool
    #: the engine's flag or mechanism ("" when it has none)
    how: str
    source: str


#: feature -> what it means
FEATURES: dict[str, str] = {
    "pd_disaggregation": "prefill and decode on separate instances, KV handed over between them",
    "chunked_prefill": "long prompts prefilled in chunks that share steps with decoding",
    "prefix_caching": "KV of a prompt prefix reused by later requests",
    "kv_cache_quantization": "KV cache stored below 16 bits",
    "cache_reuse_shift": "reuse of cached chunks at shifted positions (KV shifting)",
}

_V = "vllm 0.32.0 vllm/engine/arg_utils.py"
_S = "sglang 0.5.23 sglang/srt/arg_groups/fields"
_T = "huggingface/text-generation-inference @db931fcf"
_L = "llama.cpp b11434 llama-server --help"
_R = "NVIDIA/TensorRT-LLM tensorrt_llm/commands/serve.py @00209af1"

#: engine -> feature -> Capability
CAPABILITIES: dict[str, dict[str, Capability]] = {
    "vllm": {
        "pd_disaggregation": Capability(True, "--kv-transfer-config (disaggregated prefill)", f"{_V} kv_transfer_config"),
        "chunked_prefill": Capability(True, "--enable-chunked-prefill, --max-num-batched-tokens", f"{_V} enable_chunked_prefill"),
        "prefix_caching": Capability(True, "--enable-prefix-caching", f"{_V} enable_prefix_caching"),
        "kv_cache_quantization": Capability(True, "--kv-cache-dtype fp8", f"{_V} kv_cache_dtype"),
        "cache_reuse_shift": Capability(False, "", "vllm 0.32.0: prefix blocks are reused at their own positions only"),
    },
    "sglang": {
        "pd_disaggregation": Capability(True, "--disaggregation-mode prefill / decode",
                                        f"{_S}/disagg.py disaggregation_mode (absent in 0.4.0)"),
        "chunked_prefill": Capability(True, "--chunked-prefill-size", f"{_S}/schedule.py chunked_prefill_size"),
        "prefix_caching": Capability(True, "RadixAttention (--disable-radix-cache turns it off)",
                                     f"{_S}/memory.py disable_radix_cache"),
        "kv_cache_quantization": Capability(True, "--kv-cache-dtype fp8_e4m3 / fp8_e5m2", f"{_S}/model.py kv_cache_dtype"),
        "cache_reuse_shift": Capability(False, "", "sglang 0.5.23: the radix tree matches prefixes at their positions"),
    },
    "tgi": {
        "pd_disaggregation": Capability(False, "", f"{_T} docs/source/reference/launcher.md: no disaggregation option"),
        "chunked_prefill": Capability(True, "on by default from 3.0.0 (flashinfer/flashdecoding attention)",
                                      f"{_T} server/text_generation_server/models/globals.py PREFILL_CHUNKING"),
        "prefix_caching": Capability(True, "on by default from 2.3.0 (PREFIX_CACHING)", f"{_T} launcher/src/main.rs"),
        "kv_cache_quantization": Capability(True, "--kv-cache-dtype fp8_e4m3fn / fp8_e5m2",
                                            f"{_T} launcher/src/main.rs KVCacheDtype"),
        "cache_reuse_shift": Capability(False, "", f"{_T}: prefix caching only"),
    },
    "llamacpp": {
        "pd_disaggregation": Capability(False, "", f"{_L}: one server holds a request from prompt to last token"),
        "chunked_prefill": Capability(True, "always; chunk = -b/--batch-size", f"{_L} -b, -ub"),
        "prefix_caching": Capability(True, "per slot: cache_prompt (request), --cache-ram host cache",
                                     f"{_L} --cache-prompt, --cache-ram"),
        "kv_cache_quantization": Capability(True, "-ctk / -ctv q8_0, q4_0, ... (V needs -fa on)", f"{_L} -ctk, -ctv"),
        "cache_reuse_shift": Capability(True, "--cache-reuse N", f"{_L} --cache-reuse"),
    },
    "trtllm": {
        "pd_disaggregation": Capability(True, "trtllm-serve disaggregated (context and generation servers)",
                                        f"{_R} OpenAIDisaggServer"),
        "chunked_prefill": Capability(True, "--enable_chunked_prefill (Triton: enable_chunked_context)",
                                      f"{_R} get_llm_args"),
        "prefix_caching": Capability(True, "kv_cache_config.enable_block_reuse (Triton: enable_kv_cache_reuse)",
                                     "nvidia.github.io/TensorRT-LLM/1.4.0rc4/llm-api/reference/KvCacheConfig.html"),
        "kv_cache_quantization": Capability(True, "kv_cache_config.dtype fp8",
                                            "nvidia.github.io/TensorRT-LLM/1.4.0rc4/llm-api/reference/KvCacheConfig.html"),
        "cache_reuse_shift": Capability(False, "", "TensorRT-LLM: block reuse matches prefixes at their positions"),
    },
}


def capability(engine: str | None, feature: str) -> Capability | None:
    """The engine's entry for ``feature``, None for an engine kvdoctor does not know.
    KeyError for a feature not in :data:`FEATURES` (a misspelt name must not read as "no")."""
    if feature not in FEATURES:
        raise KeyError(f"unknown feature {feature!r}; known: {', '.join(FEATURES)}")
    table = CAPABILITIES.get(ENGINE_KNOB.get((engine or "").lower(), ""))
    return None if table is None else table[feature]


def has_feature(engine: str | None, feature: str) -> bool | None:
    """True/False for a known engine; None when the engine is unknown."""
    c = capability(engine, feature)
    return None if c is None else c.has
