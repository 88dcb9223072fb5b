"""The KV-cache memory model: how many bytes a token, a sequence and a GPU's cache hold.

Per token, per layer that keeps a K and a V tensor (MHA, GQA, MQA):
    2 x kv_heads x head_dim x bytes_per_value           (+ scales, for int8/int4)
Per token, per MLA layer (DeepSeek-V2/V3): one latent tensor, not two:
    (kv_lora_rank + qk_rope_head_dim) x bytes_per_value
A sequence is stored in blocks (pages) of ``block_size_tokens``: its length is rounded up to
whole blocks; a sliding-window layer holds at most its window (rounded up the same way).
With tensor parallelism each GPU holds ``kv_heads / tp`` heads (at least one: heads are
replicated when tp > kv_heads); an MLA latent is replicated on every GPU.
"""
from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass

from ..errors import InputError

#: Share of the KV cache kept free when sizing concurrency: `kvdoctor plan`'s --headroom default
#: and the margin in the kv_demand_over_capacity signal that the unsafe-concurrency rule reads
#: (its description and fix say "20% headroom", "0.8 x KV capacity"). A planning constant, not a
#: rule param: a signal is computed before and apart from the rules, so a param (or `--set`) could
#: not move it, and the plan must size by the same margin the rule judges by. docs/rules.md lists
#: the numbers that live in code, and why.
KV_HEADROOM_FRAC = 0.2


@dataclass(frozen=True, slots=True)
class KvDtype:
    name: str
    bytes_per_value: float
    #: bytes of scale/zero-point stored per token, per KV head, per tensor (K or V)
    scale_bytes_per_head: int = 0


#: fp8 in vLLM/SGLang uses per-tensor scales (a scalar per layer: no per-token cost);
#: int8/int4 as stored per token and head with an fp16 scale and zero point (LMDeploy style).
KV_DTYPES = {
    "fp32": KvDtype("fp32", 4),
    "fp16": KvDtype("fp16", 2),
    "bf16": KvDtype("bf16", 2),
    "fp8": KvDtype("fp8", 1),
    "int8": KvDtype("int8", 1, 4),
    "int4": KvDtype("int4", 0.5, 4),
}
_DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "auto": "bf16",
                  "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8": "fp8", "e4m3": "fp8", "e5m2": "fp8"}


def kv_dtype(name: str) -> KvDtype:
    key = _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in KV_DTYPES:
        raise InputError(f"--kv-dtype: unknown KV dtype {name!r}; expected one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[key]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the KV cache of one model depends on. ``kv_heads`` is 1 for MLA (one latent)."""

    name: str
    num_layers: int
    num_attention_heads: int
    kv_heads: int
    head_dim: int
    #: V head size when it differs from K's (MLA's MHA-equivalent comparison); None = head_dim
    v_head_dim: int | None = None
    #: MLA: kv_lora_rank + qk_rope_head_dim, one tensor per layer; 0 when not MLA
    mla_latent_dim: int = 0
    sliding_window_tokens: int | None = None
    sliding_layers: int = 0
    params: float | None = None
    weight_dtype: str = "bf16"
    #: the checkpoint's size when known (mixed-precision weights); else params x weight dtype
    weight_bytes: float | None = None
    max_position_embeddings: int | None = None
    source: str = ""

    @property
    def attention(self) -> str:
        if self.mla_latent_dim:
            return "MLA"
        if self.kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else "GQA"

    @property
    def full_layers(self) -> int:
        return self.num_layers - self.sliding_layers


def kv_heads_per_gpu(spec: ModelSpec, tp: int = 1) -> float:
    if spec.mla_latent_dim:
        return 1  # the latent is replicated on every tensor-parallel rank
    return max(1, spec.kv_heads // tp) if tp > 1 else spec.kv_heads


def kv_bytes_per_token_per_layer(spec: ModelSpec, dtype: KvDtype, tp: int = 1) -> float:
    heads = kv_heads_per_gpu(spec, tp)
    if spec.mla_latent_dim:
        return spec.mla_latent_dim * dtype.bytes_per_value + dtype.scale_bytes_per_head
    v_dim = spec.v_head_dim or spec.head_dim
    values = heads * (spec.head_dim + v_dim) * dtype.bytes_per_value
    return values + 2 * heads * dtype.scale_bytes_per_head


def kv_bytes_per_token(spec: ModelSpec, dtype: KvDtype, tp: int = 1) -> float:
    """Bytes one token adds to the cache (all layers; per GPU when tp > 1)."""
    return spec.num_layers * kv_bytes_per_token_per_layer(spec, dtype, tp)


def dtype_from_capacity(spec: ModelSpec, kv_bytes: float, capacity_tokens: float, tp: int = 1,
                        default: KvDtype | None = None) -> KvDtype | None:
    """The KV dtype whose bytes per token fit an engine's own figures (vLLM cache_config_info:
    KV memory and the tokens it holds): ``default`` where it fits (fp16 and bf16 weigh the same),
    None when no dtype is within 10% of them. vLLM's ``cache_dtype: auto`` is the model's compute
    dtype, which flags change (float32 on a CPU without native bf16): the ratio says which ran."""
    if not (kv_bytes > 0 and capacity_tokens > 0):
        return None
    per_token = kv_bytes / capacity_tokens

    def misfit(d: KvDtype) -> float:
        # capacity counts whole blocks: a partial last block makes the measured ratio a little high
        return abs(kv_bytes_per_token(spec, d, tp) / per_token - 1)

    candidates = ([default] if default else []) + list(KV_DTYPES.values())
    best = min(candidates, key=misfit)  # min keeps the first of equals: the default
    return best if misfit(best) < 0.1 else None


def round_up(n: float, block: int) -> int:
    return int(math.ceil(n / block) * block) if block > 1 else int(math.ceil(n))


def kv_bytes_per_sequence(spec: ModelSpec, dtype: KvDtype, length_tokens: float, *,
                          block_size_tokens: int = 16, tp: int = 1) -> float:
    """Bytes one sequence of ``length_tokens`` holds, paged, sliding-window layers capped."""
    per_layer = kv_bytes_per_token_per_layer(spec, dtype, tp)
    stored = round_up(length_tokens, block_size_tokens)
    full = spec.full_layers * stored * per_layer
    if not spec.sliding_layers or not spec.sliding_window_tokens:
        return full + spec.sliding_layers * stored * per_layer
    windowed = min(stored, round_up(spec.sliding_window_tokens, block_size_tokens))
    return full + spec.sliding_layers * windowed * per_layer


@dataclass(frozen=True, slots=True)
class GpuBudget:
    """The GPU side: memory per GPU and what is taken before the KV cache gets the rest."""

    gpu_mem_bytes: float
    tp: int = 1
    mem_util_frac: float = 0.9
    #: weights of the whole model; each GPU holds weight_bytes / tp
    weight_bytes: float = 0.0
    #: per GPU: activation peak + CUDA context, NCCL, CUDA graphs (non-torch memory)
    reserve_bytes: float = 2 * 2**30
    #: when the engine's log gives the KV memory, it replaces the arithmetic above
    kv_mem_override_bytes: float | None = None

    @property
    def kv_budget_bytes_per_gpu(self) -> float:
        if self.kv_mem_override_bytes is not None:
            return self.kv_mem_override_bytes
        return self.gpu_mem_bytes * self.mem_util_frac - self.weight_bytes / self.tp - self.reserve_bytes


def max_kv_tokens(spec: ModelSpec, dtype: KvDtype, budget: GpuBudget, block_size_tokens: int = 16) -> int:
    """Tokens the cache holds: whole blocks of all layers that fit in the per-GPU budget
    (as vLLM counts "GPU KV cache size" and SGLang max_total_num_tokens)."""
    avail = budget.kv_budget_bytes_per_gpu
    if avail <= 0:
        return 0
    block_bytes = kv_bytes_per_token(spec, dtype, budget.tp) * max(block_size_tokens, 1)
    return int(avail // block_bytes) * max(block_size_tokens, 1)


def max_concurrency(spec: ModelSpec, dtype: KvDtype, budget: GpuBudget, length_tokens: float,
                    block_size_tokens: int = 16) -> float:
    """Sequences of ``length_tokens`` the cache holds at once (fractional, like vLLM's "x")."""
    seq = kv_bytes_per_sequence(spec, dtype, length_tokens, block_size_tokens=block_size_tokens, tp=budget.tp)
    avail = max_kv_tokens(spec, dtype, budget, block_size_tokens) * kv_bytes_per_token(spec, dtype, budget.tp)
    return avail / seq if seq > 0 else 0.0


def safe_concurrency(spec: ModelSpec, dtype: KvDtype, budget: GpuBudget, length_tokens: float,
                     block_size_tokens: int = 16, headroom_frac: float = KV_HEADROOM_FRAC) -> int:
    """Whole sequences that fit while keeping ``headroom_frac`` of the cache free."""
    return int(math.floor(max_concurrency(spec, dtype, budget, length_tokens, block_size_tokens)
                          * (1 - headroom_frac) + 1e-9))


# -- Hugging Face config.json ---------------------------------------------------------------
_QUANT_WEIGHTS = {"fp8": "fp8", "fbgemm_fp8": "fp8", "mxfp4": "mxfp4", "modelopt_fp4": "nvfp4"}


def _field(cfg: dict, path: str, *keys: str, required: bool = True):
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise InputError(f"{path}: field {k}: expected a positive integer, got {v!r}")
            return int(v)
    if required:
        raise InputError(f"{path}: field {keys[0]}: missing; expected a positive integer "
                         "(a decoder's Hugging Face config.json has it)")
    return None


def _sliding_layers(cfg: dict, n: int) -> int:
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return sum(1 for t in types if "sliding" in str(t) or "local" in str(t))
    mt = str(cfg.get("model_type", ""))
    if mt == "gemma2":
        return (n + 1) // 2  # even layers slide, odd layers are global
    if mt.startswith("gemma3"):
        return n - n // int(cfg.get("sliding_window_pattern") or 6)
    if "use_sliding_window" in cfg:  # Qwen2/Qwen3: off unless asked for, then above max_window_layers
        return max(0, n - int(cfg.get("max_window_layers") or 0)) if cfg["use_sliding_window"] else 0
    return n  # Mistral-style: every layer slides


def estimate_params(cfg: dict, layers: int, heads: int, kv: int, hd: int) -> float | None:
    """Parameters from the shapes (dense, MoE, MLA); None when the shapes are not all given."""
    h, inter, vocab = cfg.get("hidden_size") or cfg.get("d_model"), cfg.get("intermediate_size"), cfg.get("vocab_size")
    if not (h and vocab and (inter or cfg.get("ffn_dim"))):
        return None
    if cfg.get("kv_lora_rank"):
        qr, kr, rope = cfg.get("q_lora_rank") or 0, cfg["kv_lora_rank"], cfg.get("qk_rope_head_dim", 0)
        vd = cfg.get("v_head_dim") or hd
        q = h * qr + qr * heads * hd if qr else h * heads * hd
        attn = q + h * (kr + rope) + kr * heads * (hd - rope + vd) + heads * vd * h
    else:
        attn = 2 * h * heads * hd + 2 * h * kv * hd
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if cfg.get("ffn_dim"):  # OPT-style two-matrix MLP
        mlp_dense = mlp_moe = 2 * h * cfg["ffn_dim"]
    else:
        mlp_dense = 3 * h * inter
        moe_inter = cfg.get("moe_intermediate_size") or inter
        mlp_moe = 3 * h * moe_inter * (experts + (cfg.get("n_shared_experts") or 0)) if experts else mlp_dense
    dense_layers = min(layers, cfg.get("first_k_dense_replace") or 0) if experts else layers
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return float(embed + layers * attn + dense_layers * mlp_dense + (layers - dense_layers) * mlp_moe)


def spec_from_hf_config(cfg: dict, path: str) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json (text_config used for multimodal models)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    layers = _field(cfg, path, "num_hidden_layers", "n_layer", "num_layers")
    heads = _field(cfg, path, "num_attention_heads", "n_head")
    kv = _field(cfg, path, "num_key_value_heads", "num_kv_heads", required=False)
    if kv is None:
        kv = 1 if cfg.get("multi_query") else heads
    hidden = _field(cfg, path, "hidden_size", "d_model", "n_embd", required=False)
    hd = _field(cfg, path, "head_dim", required=False)
    mla = v_hd = 0
    if cfg.get("kv_lora_rank"):
        rope = _field(cfg, path, "qk_rope_head_dim")
        mla = _field(cfg, path, "kv_lora_rank") + rope
        hd = _field(cfg, path, "qk_nope_head_dim") + rope
        v_hd = _field(cfg, path, "v_head_dim", required=False) or hd
        kv = 1
    if hd is None:
        if hidden is None:
            raise InputError(f"{path}: field head_dim: missing, and no hidden_size to derive it from")
        hd = hidden // heads
    window = cfg.get("sliding_window") if isinstance(cfg.get("sliding_window"), int) else None
    sliding = _sliding_layers(cfg, layers) if window else 0
    quant = cfg.get("quantization_config") or {}
    wdt = _QUANT_WEIGHTS.get(str(quant.get("quant_method", "")).lower())
    if wdt is None and quant.get("bits") in (4, 8):
        wdt = f"int{quant['bits']}"
    if wdt is None:
        wdt = {"float16": "fp16"}.get(str(cfg.get("torch_dtype") or cfg.get("dtype")), "bf16")
    p = Path(path)
    name = cfg.get("_name_or_path") or (p.parent.name if p.name == "config.json" else p.stem)
    return ModelSpec(name=str(name), num_layers=layers, num_attention_heads=heads, kv_heads=kv, head_dim=hd,
                     v_head_dim=v_hd or None, mla_latent_dim=mla, sliding_window_tokens=window,
                     sliding_layers=min(sliding, layers), params=estimate_params(cfg, layers, heads, kv, hd),
                     weight_dtype=wdt, max_position_embeddings=cfg.get("max_position_embeddings"), source=path)
