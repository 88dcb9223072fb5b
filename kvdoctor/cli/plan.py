"""`kvdoctor plan`: KV-cache capacity planning."""
from __future__ import annotations

import dataclasses

import click
import orjson

from ..errors import InputError
from ..plan.kvmodel import KV_HEADROOM_FRAC
from . import params as P
from .common import format_option, output_option, write_out


@click.command("plan")
@click.option("--model", "model", metavar="CONFIG_OR_NAME",
              help="A Hugging Face config.json (or its folder), or a built-in model name.")
@click.option("--max-len", type=P.TOKENS, metavar="N", help="Planned tokens per request (prompt + output).")
@click.option("--concurrency", type=P.Count(1, 1_000_000, "of requests"), metavar="C", help="Concurrent requests you intend to run.")
@click.option("--gpu-mem", metavar="SIZE|GPU", help="Memory per GPU: 80GiB, 80GB, or a GPU name (H100, "
              "A100-80GB, L4...). Default: read through NVML when a GPU is present.")
@click.option("--tp", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="Tensor-parallel size; must divide the model's KV heads (or be a multiple of them), as engines require.")
@click.option("--kv-dtype", default=None, metavar="DTYPE",
              help="fp32|fp16|bf16|fp8|int8|int4. Default: the one the --from-capture engine used (its KV bytes over the tokens they hold, vLLM), else the model's dtype.")
@click.option("--mem-util", type=P.Share(0.01, 1.0), default=0.9, show_default=True,
              help="Share of GPU memory the engine may use (vLLM gpu_memory_utilization, "
                   "SGLang mem_fraction_static).")
@click.option("--weights", type=P.Size(min_bytes=1), metavar="SIZE", help="Weight bytes of the whole model (default: parameters x dtype).")
@click.option("--params", metavar="COUNT", help="Parameter count, e.g. 8B (overrides the table/estimate).")
@click.option("--reserve", type=P.Size(min_bytes=0), metavar="SIZE", default="2GiB", show_default=True,
              help="Per GPU: activation peak plus non-torch memory (CUDA context, NCCL, CUDA graphs).")
@click.option("--kv-mem", type=P.Size(min_bytes=1), metavar="SIZE", help="KV cache memory per GPU as the engine logged it; "
              "replaces the GPU arithmetic.")
@click.option("--block-size", type=click.IntRange(1, 1 << 20), default=None,
              help="Tokens per KV block (page); sequences are rounded up to whole blocks. "
                   "[default: the capture's (vLLM cache_config_info), else 16]")
@click.option("--headroom", type=P.Share(0.0, 0.95), default=KV_HEADROOM_FRAC, show_default=True,
              help="Share of the cache kept free when computing the safe concurrency.")
@click.option("--from-capture", "capture", metavar="CAPTURE", type=click.Path(exists=True, file_okay=False),
              help="Also size for the P95/P99 prompt+output length of this capture; its engine's KV bytes and "
                   "block size (vLLM cache_config_info) stand in for --kv-mem and --block-size when not given.")
@format_option()
@output_option
@click.option("--list-models", is_flag=True, help="List the built-in models and GPUs, then exit.")
def command(model, max_len, concurrency, gpu_mem, tp, kv_dtype, mem_util, weights, params, reserve, kv_mem,
            block_size, headroom, capture, fmt, output, list_models) -> None:
    """How many concurrent requests at a given context fit on this GPU, with the arithmetic.

    \b
    Examples:
      kvdoctor plan --model Llama-3.1-8B --max-len 32768 --gpu-mem H100
      kvdoctor plan --model ./Qwen3-32B/config.json --max-len 8192 --gpu-mem 80GiB --tp 2 --kv-dtype fp8
      kvdoctor plan --model Llama-3.1-70B --max-len 131072 --gpu-mem H200 --tp 4 --concurrency 16
      kvdoctor plan --model Qwen3-14B --max-len 32768 --kv-mem 6.51GiB      # check an engine's log
      kvdoctor plan --model Llama-3.1-8B --max-len 8192 --gpu-mem L4 --from-capture cap/ --format json
    """
    from ..plan import kvmodel as km
    from ..plan.models import GPUS, model_names, parse_bytes, parse_count, resolve_model
    from ..plan.planner import PlanInputs, capture_lengths, plan, render_text, resolve_gpu

    if list_models:
        write_out("models: " + ", ".join(model_names()) + "\ngpus:   " + ", ".join(GPUS) + "\n", output)
        return
    if not model:
        raise InputError("--model: required; give a config.json path or a built-in name (see --list-models)")
    if not max_len:
        raise InputError("--max-len: required; expected a positive number of tokens, e.g. --max-len 32768")
    spec = resolve_model(model)
    _check_tp(spec, tp)
    if params:
        spec = dataclasses.replace(spec, params=parse_count(params, "--params"), weight_bytes=None)
    lengths = capture_lengths(capture) if capture else None
    dtype = km.kv_dtype(kv_dtype or ("fp16" if spec.weight_dtype == "fp16" else "bf16"))
    if not kv_dtype and lengths:  # the KV dtype the engine ran, from its own bytes over tokens
        dtype = km.dtype_from_capacity(spec, lengths.get("kv_cache_bytes", 0), lengths.get("kv_capacity_tokens", 0),
                                       tp, default=dtype) or dtype
    if lengths and not kv_mem and not gpu_mem and lengths.get("kv_cache_bytes"):
        kv_mem = str(lengths["kv_cache_bytes"])  # what the engine gave its KV cache
    block_size = block_size or (lengths or {}).get("kv_block_size_tokens") or 16
    gpu = resolve_gpu(gpu_mem)
    budget = None
    if gpu or kv_mem:
        from ..plan.planner import weight_bytes
        name, mem = gpu if gpu else (None, 0.0)
        wbytes = parse_bytes(weights, "--weights") if weights else (weight_bytes(spec) if not kv_mem else 0.0)
        kv_override = parse_bytes(kv_mem, "--kv-mem") if kv_mem else None
        if kv_override is not None and kv_override <= 0:
            raise InputError(f"--kv-mem {kv_mem!r}: expected the KV cache size the engine logged, above 0 (e.g. 6.51GiB)")
        budget = km.GpuBudget(gpu_mem_bytes=mem, tp=tp, mem_util_frac=mem_util, weight_bytes=wbytes,
                              reserve_bytes=parse_bytes(reserve, "--reserve"), kv_mem_override_bytes=kv_override)
        if budget.kv_budget_bytes_per_gpu <= 0:
            raise InputError(f"--gpu-mem: {name or gpu_mem} leaves no room for the KV cache "
                             f"({mem / 2**30:.1f} GiB x {mem_util:g} minus {wbytes / tp / 2**30:.1f} GiB weights per "
                             f"GPU minus the reserve); raise --tp, --mem-util or lower --reserve")
    inputs = PlanInputs(spec=spec, max_len_tokens=max_len, kv_dtype=dtype, budget=budget,
                        gpu_name=gpu[0] if gpu else None, block_size_tokens=block_size, concurrency=concurrency,
                        headroom_frac=headroom, capture=lengths)
    result = plan(inputs)
    if fmt == "json":
        text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n"
    elif fmt == "markdown":
        from .advise import fenced

        text = fenced(f"kvdoctor plan · {spec.name}", render_text(result))
    else:
        text = render_text(result) + "\n"
    write_out(text, output)


def _check_tp(spec, tp: int) -> None:
    """Engines shard attention heads over tensor-parallel ranks: the TP degree must divide the
    attention heads, and divide the KV heads (or be a multiple of them: each is then replicated).
    vLLM refuses anything else at start-up; a plan for it would be a plan for nothing."""
    if tp == 1:
        return
    kv = spec.kv_heads
    if not spec.mla_latent_dim and ((tp <= kv and kv % tp) or (tp > kv and tp % kv)):
        raise InputError(f"--tp {tp}: {spec.name} has {kv} KV heads; the TP degree must divide them or be a multiple "
                         f"of them, as engines require (try {_divisors(kv, tp)})")
    if spec.num_attention_heads % tp:
        raise InputError(f"--tp {tp}: {spec.name} has {spec.num_attention_heads} attention heads, which {tp} does not "
                         f"divide; engines refuse it (try {_divisors(spec.num_attention_heads, tp)})")


def _divisors(n: int, near: int) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(str(d) for d in sorted(ds, key=lambda d: (abs(d - near), d))[:3])
