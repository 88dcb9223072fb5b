"""Built-in model and GPU tables, Hugging Face config.json reading, and size parsing.

Every model row names its source: the model's config.json on the Hugging Face Hub, from which
layers, attention heads, KV heads, head size, sliding window and context length were taken.
GPU memory is the total the driver reports (nvidia-smi "MiB"), slightly above what CUDA
hands out; give ``--gpu-mem`` with the engine's own figure when comparing to its log.
"""
from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

from ..errors import InputError
from .kvmodel import ModelSpec, spec_from_hf_config

HF = "https://huggingface.co/{}/blob/main/config.json"
GiB, MiB = 2**30, 2**20

# name: (layers, heads, kv_heads, head_dim, params, max_pos, weight dtype, hf repo, extras)
_MODELS = {
    "Llama-2-7B": (32, 32, 32, 128, 6.74e9, 4096, "fp16", "meta-llama/Llama-2-7b-hf", {}),
    "Llama-2-13B": (40, 40, 40, 128, 13.0e9, 4096, "fp16", "meta-llama/Llama-2-13b-hf", {}),
    "Llama-2-70B": (80, 64, 8, 128, 69.0e9, 4096, "fp16", "meta-llama/Llama-2-70b-hf", {}),
    "Llama-3-8B": (32, 32, 8, 128, 8.03e9, 8192, "bf16", "meta-llama/Meta-Llama-3-8B", {}),
    "Llama-3-70B": (80, 64, 8, 128, 70.6e9, 8192, "bf16", "meta-llama/Meta-Llama-3-70B", {}),
    "Llama-3.1-8B": (32, 32, 8, 128, 8.03e9, 131072, "bf16", "meta-llama/Llama-3.1-8B", {}),
    "Llama-3.1-70B": (80, 64, 8, 128, 70.6e9, 131072, "bf16", "meta-llama/Llama-3.1-70B", {}),
    "Llama-3.1-405B": (126, 128, 8, 128, 405.9e9, 131072, "bf16", "meta-llama/Llama-3.1-405B", {}),
    "Llama-3.2-1B": (16, 32, 8, 64, 1.24e9, 131072, "bf16", "meta-llama/Llama-3.2-1B", {}),
    "Llama-3.2-3B": (28, 24, 8, 128, 3.21e9, 131072, "bf16", "meta-llama/Llama-3.2-3B", {}),
    "Llama-3.3-70B": (80, 64, 8, 128, 70.6e9, 131072, "bf16", "meta-llama/Llama-3.3-70B-Instruct", {}),
    "Qwen2.5-7B": (28, 28, 4, 128, 7.62e9, 32768, "bf16", "Qwen/Qwen2.5-7B-Instruct", {}),
    "Qwen2.5-14B": (48, 40, 8, 128, 14.8e9, 32768, "bf16", "Qwen/Qwen2.5-14B-Instruct", {}),
    "Qwen2.5-32B": (64, 40, 8, 128, 32.8e9, 32768, "bf16", "Qwen/Qwen2.5-32B-Instruct", {}),
    "Qwen2.5-72B": (80, 64, 8, 128, 72.7e9, 32768, "bf16", "Qwen/Qwen2.5-72B-Instruct", {}),
    "Qwen3-8B": (36, 32, 8, 128, 8.19e9, 40960, "bf16", "Qwen/Qwen3-8B", {}),
    "Qwen3-14B": (40, 40, 8, 128, 14.8e9, 40960, "bf16", "Qwen/Qwen3-14B", {}),
    "Qwen3-32B": (64, 64, 8, 128, 32.8e9, 40960, "bf16", "Qwen/Qwen3-32B", {}),
    "Qwen3-30B-A3B": (48, 32, 4, 128, 30.5e9, 40960, "bf16", "Qwen/Qwen3-30B-A3B", {}),
    "Qwen3-235B-A22B": (94, 64, 4, 128, 235e9, 40960, "bf16", "Qwen/Qwen3-235B-A22B", {}),
    "Mistral-7B-v0.1": (32, 32, 8, 128, 7.24e9, 32768, "bf16", "mistralai/Mistral-7B-v0.1",
                        {"sliding_window_tokens": 4096, "sliding_layers": 32}),
    "Mistral-7B-v0.3": (32, 32, 8, 128, 7.25e9, 32768, "bf16", "mistralai/Mistral-7B-v0.3", {}),
    "Mixtral-8x7B": (32, 32, 8, 128, 46.7e9, 32768, "bf16", "mistralai/Mixtral-8x7B-v0.1", {}),
    "Mixtral-8x22B": (56, 48, 8, 128, 141e9, 65536, "bf16", "mistralai/Mixtral-8x22B-v0.1", {}),
    "Gemma-2-2B": (26, 8, 4, 256, 2.61e9, 8192, "bf16", "google/gemma-2-2b",
                   {"sliding_window_tokens": 4096, "sliding_layers": 13}),
    "Gemma-2-9B": (42, 16, 8, 256, 9.24e9, 8192, "bf16", "google/gemma-2-9b",
                   {"sliding_window_tokens": 4096, "sliding_layers": 21}),
    "Gemma-2-27B": (46, 32, 16, 128, 27.2e9, 8192, "bf16", "google/gemma-2-27b",
                    {"sliding_window_tokens": 4096, "sliding_layers": 23}),
    "Gemma-3-4B": (34, 8, 4, 256, 4.3e9, 131072, "bf16", "google/gemma-3-4b-it",
                   {"sliding_window_tokens": 1024, "sliding_layers": 29}),
    "Gemma-3-12B": (48, 16, 8, 256, 12.2e9, 131072, "bf16", "google/gemma-3-12b-it",
                    {"sliding_window_tokens": 1024, "sliding_layers": 40}),
    "Gemma-3-27B": (62, 32, 16, 128, 27.4e9, 131072, "bf16", "google/gemma-3-27b-it",
                    {"sliding_window_tokens": 1024, "sliding_layers": 52}),
    "DeepSeek-V2-Lite": (27, 16, 1, 192, 15.7e9, 163840, "bf16", "deepseek-ai/DeepSeek-V2-Lite",
                         {"mla_latent_dim": 576, "v_head_dim": 128}),
    "DeepSeek-V3": (61, 128, 1, 192, 671e9, 163840, "fp8", "deepseek-ai/DeepSeek-V3",
                    {"mla_latent_dim": 576, "v_head_dim": 128}),
    "DeepSeek-R1": (61, 128, 1, 192, 671e9, 163840, "fp8", "deepseek-ai/DeepSeek-R1",
                    {"mla_latent_dim": 576, "v_head_dim": 128}),
    "GPT-OSS-20B": (24, 64, 8, 64, 20.9e9, 131072, "mxfp4", "openai/gpt-oss-20b",
                    {"sliding_window_tokens": 128, "sliding_layers": 12, "weight_bytes": 13.8e9}),
    "GPT-OSS-120B": (36, 64, 8, 64, 116.8e9, 131072, "mxfp4", "openai/gpt-oss-120b",
                     {"sliding_window_tokens": 128, "sliding_layers": 18, "weight_bytes": 65.3e9}),
    "OPT-13B": (40, 40, 40, 128, 12.9e9, 2048, "fp16", "facebook/opt-13b", {}),
}

#: bytes per parameter of weights by dtype (mxfp4: 4-bit values + a shared scale per 32)
WEIGHT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5, "mxfp4": 0.53, "nvfp4": 0.5625}

# GPU: memory the driver reports (nvidia-smi), per GPU
GPUS = {
    "H100-80GB": 81559 * MiB, "H200": 143771 * MiB, "A100-40GB": 40960 * MiB, "A100-80GB": 81920 * MiB,
    "L4": 23034 * MiB, "A10G": 23028 * MiB, "A10": 23028 * MiB, "T4": 15360 * MiB, "L40S": 46068 * MiB,
    "L40": 46068 * MiB, "MI300X": 192 * GiB, "RTX-4090": 24564 * MiB, "RTX-3090": 24576 * MiB,
    "V100-16GB": 16384 * MiB, "V100-32GB": 32768 * MiB,
}
#: peak memory bandwidth, bytes/s, from the vendors' data sheets (SXM parts where there are two;
#: a PCIe A100-80GB has 1.94 TB/s, an H100 PCIe 2.0 TB/s): decode reads weights + KV per step
GPU_MEM_BW = {
    "H100-80GB": 3.35e12, "H200": 4.8e12, "A100-40GB": 1.555e12, "A100-80GB": 2.039e12, "L4": 300e9,
    "A10G": 600e9, "A10": 600e9, "T4": 320e9, "L40S": 864e9, "L40": 864e9, "MI300X": 5.3e12,
    "RTX-4090": 1.008e12, "RTX-3090": 936e9, "V100-16GB": 900e9, "V100-32GB": 900e9,
}
_GPU_ALIASES = {"h100": "H100-80GB", "h100sxm": "H100-80GB", "h100pcie": "H100-80GB", "h200141gb": "H200",
                "h200sxm": "H200", "4090": "RTX-4090", "3090": "RTX-3090", "geforcertx4090": "RTX-4090"}
_AMBIGUOUS = {"a100": ("A100-40GB", "A100-80GB"), "v100": ("V100-16GB", "V100-32GB")}


def _key(name: str) -> str:
    s = name.strip().lower().split("/")[-1]
    s = re.sub(r"^(meta-|nvidia-)", "", s)
    s = re.sub(r"-(instruct|chat|hf|it|base)(-\d+)?$", "", s)
    return re.sub(r"[-_ ]", "", s)


_BY_KEY = {_key(n): n for n in _MODELS}


def builtin_model(name: str) -> ModelSpec:
    key, fp8 = _key(name), False
    if key not in _BY_KEY and key.endswith("fp8"):  # e.g. Qwen3-235B-A22B-FP8: same KV, FP8 weights
        key, fp8 = key[:-3], True
    hit = _BY_KEY.get(key)
    if hit is None:
        near = difflib.get_close_matches(name, list(_MODELS), n=3, cutoff=0.4)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise InputError(f"--model: {name!r} is neither a config.json path nor a built-in model{hint} "
                         f"(see `kvdoctor plan --list-models`)")
    layers, heads, kv, hd, params, max_pos, wdt, repo, extra = _MODELS[hit]
    return ModelSpec(hit + ("-FP8" if fp8 else ""), layers, heads, kv, hd, params=params,
                     weight_dtype="fp8" if fp8 else wdt, max_position_embeddings=max_pos,
                     source=HF.format(repo), **extra)


def model_names() -> list[str]:
    return list(_MODELS)


def gpu_memory(name: str) -> tuple[str, float] | None:
    """(canonical name, bytes) for a known GPU name, None when the text is not a GPU name."""
    k = re.sub(r"[-_ ]", "", name.strip().lower()).removeprefix("nvidia").removeprefix("amd")
    if k in _AMBIGUOUS:
        raise InputError(f"--gpu-mem: {name!r} comes in several sizes; say {' or '.join(_AMBIGUOUS[k])}")
    for canon, b in GPUS.items():
        if re.sub(r"[-_ ]", "", canon.lower()) == k:
            return canon, b
    return (_GPU_ALIASES[k], GPUS[_GPU_ALIASES[k]]) if k in _GPU_ALIASES else None


def gpu_bandwidth(name: str) -> tuple[str, float, float] | None:
    """(canonical name, memory bytes, peak bandwidth bytes/s) for a known GPU name (NVML's
    "NVIDIA A100-SXM4-80GB" too), None when unknown or ambiguous."""
    k = re.sub(r"[-_ ]", "", name.strip().lower()).removeprefix("nvidia").removeprefix("amd").removeprefix("tesla")
    k = re.sub(r"(sxm\d?|pcie|hbm\d?e?)", "", k)
    k = {"a10080g": "a10080gb", "a10040g": "a10040gb"}.get(k, k)
    try:
        named = gpu_memory(k)
    except InputError:
        return None
    if not named or named[0] not in GPU_MEM_BW:
        return None
    return named[0], named[1], GPU_MEM_BW[named[0]]


def nvml_gpu() -> tuple[str, float] | None:
    """The first GPU's (name, total bytes) through NVML, or None without a GPU or pynvml."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            return name, float(pynvml.nvmlDeviceGetMemoryInfo(h).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no library, no driver, no device: fall back to the user's --gpu-mem
        return None


def parse_bytes(text: str, field: str) -> float:
    """'80GiB' (binary), '80GB' (decimal), '80G' (binary), through the one size parser
    (kvdoctor.units.parse_size); a bare number must be bytes >= 1 MiB (a bare "80" is a slip)."""
    from ..units import parse_size

    try:
        value = parse_size(text)
    except ValueError as e:
        raise InputError(f"{field}: cannot read {text!r} as a size ({e}); expected e.g. 80GiB, 80GB or 24576MiB") from None
    bare = re.fullmatch(r"\s*[0-9.e+-]+\s*", str(text).lower()) is not None
    if bare and 0 < value < MiB:
        raise InputError(f"{field}: {text!r} bytes is less than 1 MiB; give the unit, e.g. {str(text).strip()}GiB")
    return value


#: parameter counts a served model has: from ~100 million (SmolLM2-135M) to a few trillion
MIN_PARAMS, MAX_PARAMS = 1e6, 1e14


def parse_count(text: str, field: str) -> float:
    """A parameter count: ``8B``, ``70.6B``, ``135M``, ``8.03e9``; a count outside
    [MIN_PARAMS, MAX_PARAMS] (``8`` meant as 8B) is refused rather than planned with."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", str(text).lower())
    if not m:
        raise InputError(f"{field}: cannot read {text!r} as a count; expected e.g. 8B, 70.6B or 8.03e9")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)]
    if not MIN_PARAMS <= value <= MAX_PARAMS:
        hint = f"; did you mean {str(text).strip()}B?" if not m.group(2) and float(m.group(1)) < 1e4 else ""
        raise InputError(f"{field}: {text!r} is {value:,.0f} parameters, not a model's size (expected "
                         f"{MIN_PARAMS:.0e} to {MAX_PARAMS:.0e}, e.g. 8B or 135M){hint}")
    return value


def resolve_model(text: str) -> ModelSpec:
    """A config.json file, a folder holding one, or a built-in model name."""
    p = Path(text).expanduser()
    if p.is_dir():
        p = p / "config.json"
        if not p.exists():
            raise InputError(f"--model: {p.parent}: no config.json in this folder")
    if p.is_file():
        return spec_from_hf_config(load_json(p), str(p))
    if "/" in text and text.endswith(".json"):
        raise InputError(f"--model: {text}: no such file")
    return builtin_model(text)


def load_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not a readable JSON file ({e}); expected a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    return data
