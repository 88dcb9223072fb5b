"""The answers of `kvdoctor plan`: KV per token and sequence, tokens that fit, safe concurrency
(at the planned length and at a capture's P95/P99 length), and the ordered levers."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from . import kvmodel as km
from .forecast import unsafe_concurrency
from .models import WEIGHT_BYTES, gpu_memory, nvml_gpu, parse_bytes



@dataclass(frozen=True, slots=True)
class PlanInputs:
    spec: km.ModelSpec
    max_len_tokens: int
    kv_dtype: km.KvDtype
    budget: km.GpuBudget | None = None
    gpu_name: str | None = None
    block_size_tokens: int = 16
    concurrency: int | None = None
    headroom_frac: float = km.KV_HEADROOM_FRAC
    #: from --from-capture: {"path", "requests", "p95_len_tokens", "p99_len_tokens", "max_concurrency"}
    capture: dict | None = None


def resolve_gpu(gpu_mem: str | None) -> tuple[str | None, float] | None:
    """--gpu-mem as a size or a GPU name; without it, NVML when a GPU is present; else None."""
    if gpu_mem:
        named = gpu_memory(gpu_mem)
        if named:
            return named
        from ..units import parse_size
        from .models import GPUS

        try:
            parse_size(gpu_mem)
        except ValueError:
            raise InputError(f"--gpu-mem {gpu_mem!r}: neither a size (80GiB, 80GB) nor a known GPU; GPUs: "
                             f"{', '.join(GPUS)}") from None
        size = parse_bytes(gpu_mem, "--gpu-mem")
        if size <= 0:
            raise InputError(f"--gpu-mem {gpu_mem!r}: expected the GPU's memory, above 0 (e.g. 80GiB)")
        return None, size
    return nvml_gpu()


def weight_bytes(spec: km.ModelSpec) -> float:
    if spec.weight_bytes:
        return spec.weight_bytes
    if not spec.params:
        raise InputError(f"--weights: the parameter count of {spec.name} is unknown (its config.json lacks "
                         "hidden_size/intermediate_size/vocab_size); give --weights 16GiB or --params 8B")
    return spec.params * WEIGHT_BYTES.get(spec.weight_dtype, 2)


def capture_lengths(path: str) -> dict:
    """P95/P99 of prompt+output tokens per request in a capture, and its configured concurrency."""
    from ..capture import load

    cap = load(path)
    total = cap.requests.num("prompt_tokens") + np.nan_to_num(cap.requests.num("output_tokens"))
    total = total[np.isfinite(total) & (total > 0)]
    if not len(total):
        raise InputError(f"{path}: no request has prompt_tokens; expected requests-*.jsonl records "
                         "with prompt_tokens (and output_tokens) to take P95/P99 lengths from")
    conf = cap.meta.config or {}
    maxc = next((conf[k] for k in ("max_num_seqs", "max_running_requests", "max_concurrency") if conf.get(k)), None)
    # the engine's own KV figures where it published them (vLLM cache_config_info)
    kv = {k: int(conf[k]) for k in ("kv_cache_bytes", "kv_block_size_tokens", "kv_capacity_tokens")
          if isinstance(conf.get(k), (int, float)) and not isinstance(conf.get(k), bool) and conf[k] > 0}
    return {"path": str(path), "requests": int(len(total)),
            "p95_len_tokens": int(np.ceil(np.percentile(total, 95))),
            "p99_len_tokens": int(np.ceil(np.percentile(total, 99))),
            "max_concurrency": int(maxc) if maxc else None, **kv}


def _at(inp: PlanInputs, spec: km.ModelSpec, dtype: km.KvDtype, length: float) -> dict:
    """Per-GPU sequence bytes and (with a budget) max and safe concurrency at one length."""
    tp = inp.budget.tp if inp.budget else 1
    seq = km.kv_bytes_per_sequence(spec, dtype, length, block_size_tokens=inp.block_size_tokens, tp=tp)
    out = {"len_tokens": int(length), "kv_bytes_per_sequence_per_gpu": seq}
    if inp.budget:
        out["max_concurrency"] = km.max_concurrency(spec, dtype, inp.budget, length, inp.block_size_tokens)
        out["safe_concurrency"] = km.safe_concurrency(spec, dtype, inp.budget, length, inp.block_size_tokens,
                                                      inp.headroom_frac)
    return out


def _levers(inp: PlanInputs, base: dict) -> list[dict]:
    spec, n, dt = inp.spec, inp.max_len_tokens, inp.kv_dtype
    levers = []
    safe = base.get("safe_concurrency")
    lv = {"lever": "lower-concurrency", "safe_concurrency": safe, "requested_concurrency": inp.concurrency}
    if inp.concurrency and safe is not None:
        need = inp.concurrency * base["kv_bytes_per_sequence_per_gpu"]
        usable = inp.budget.kv_budget_bytes_per_gpu * (1 - inp.headroom_frac)
        lv.update(kv_bytes_needed_per_gpu=need, kv_bytes_usable_per_gpu=usable, fits=inp.concurrency <= safe)
    levers.append(lv)
    target = "fp8" if dt.bytes_per_value > 1 else ("int4" if dt.bytes_per_value > 0.5 else None)
    if target:
        q = km.KV_DTYPES[target]
        levers.append({"lever": "kv-quantisation", "kv_dtype": target,
                       "kv_bytes_per_token": km.kv_bytes_per_token(spec, q), **_at(inp, spec, q, n)})
    if spec.sliding_layers and spec.sliding_window_tokens:
        levers.append({"lever": "sliding-window", "already": True, "window_tokens": spec.sliding_window_tokens,
                       "sliding_layers": spec.sliding_layers, **_at(inp, spec, dt, n)})
    else:
        w = 4096 if n > 4096 else max(inp.block_size_tokens, n // 4)
        sw = dataclasses.replace(spec, sliding_window_tokens=w, sliding_layers=spec.num_layers)
        levers.append({"lever": "sliding-window", "already": False, "window_tokens": w,
                       "sliding_layers": spec.num_layers, **_at(inp, sw, dt, n)})
    variants = {"MHA": spec.num_attention_heads, "GQA": min(8, spec.num_attention_heads) if spec.kv_heads in
                (1, spec.num_attention_heads) else spec.kv_heads, "MQA": 1}
    rows = []
    for kind, heads in variants.items():
        v = dataclasses.replace(spec, kv_heads=heads, mla_latent_dim=0)
        rows.append({"attention": f"{kind}-{heads}" if kind == "GQA" else kind, "kv_heads": heads,
                     "kv_bytes_per_token": km.kv_bytes_per_token(v, dt), "current": spec.attention == kind
                     and (kind != "GQA" or heads == spec.kv_heads), **_at(inp, v, dt, n)})
    if spec.mla_latent_dim:
        rows.append({"attention": "MLA", "kv_heads": 1, "kv_bytes_per_token": km.kv_bytes_per_token(spec, dt),
                     "current": True, **_at(inp, spec, dt, n)})
    levers.append({"lever": "attention-variant", "variants": rows})
    return levers


def plan(inp: PlanInputs) -> dict:
    spec, n, dt, b = inp.spec, inp.max_len_tokens, inp.kv_dtype, inp.budget
    if n <= 0:
        raise InputError(f"--max-len: expected a positive number of tokens, got {n}")
    tp = b.tp if b else 1
    at = _at(inp, spec, dt, n)
    out = {
        "model": spec.name, "model_source": spec.source, "attention": spec.attention, "layers": spec.num_layers,
        "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "mla_latent_dim": spec.mla_latent_dim or None,
        "sliding_window_tokens": spec.sliding_window_tokens if spec.sliding_layers else None,
        "sliding_layers": spec.sliding_layers, "kv_dtype": dt.name, "kv_bytes_per_value": dt.bytes_per_value,
        "kv_bytes_per_token": km.kv_bytes_per_token(spec, dt),
        "kv_bytes_per_token_per_gpu": km.kv_bytes_per_token(spec, dt, tp),
        "max_len_tokens": n, "block_size_tokens": inp.block_size_tokens,
        "kv_bytes_per_sequence": km.kv_bytes_per_sequence(spec, dt, n, block_size_tokens=inp.block_size_tokens),
        "kv_bytes_per_sequence_per_gpu": at["kv_bytes_per_sequence_per_gpu"],
        "gpu": None, "max_kv_tokens": None, "max_concurrency": None, "safe_concurrency": None,
        "headroom_frac": inp.headroom_frac, "requested_concurrency": inp.concurrency, "capture": None,
    }
    if spec.max_position_embeddings and n > spec.max_position_embeddings:
        out["warning"] = f"--max-len {n:,} exceeds the model's context ({spec.max_position_embeddings:,} tokens)"
    if b:
        out["gpu"] = {"name": inp.gpu_name, "gpu_mem_bytes": b.gpu_mem_bytes, "tp": b.tp,
                      "mem_util_frac": b.mem_util_frac, "weight_bytes": b.weight_bytes,
                      "weight_bytes_per_gpu": b.weight_bytes / b.tp, "reserve_bytes": b.reserve_bytes,
                      "kv_mem_override_bytes": b.kv_mem_override_bytes,
                      "kv_budget_bytes_per_gpu": b.kv_budget_bytes_per_gpu}
        out["max_kv_tokens"] = km.max_kv_tokens(spec, dt, b, inp.block_size_tokens)
        out["max_concurrency"], out["safe_concurrency"] = at["max_concurrency"], at["safe_concurrency"]
    if inp.capture:
        c = dict(inp.capture)
        for q in ("p95", "p99"):
            r = _at(inp, spec, dt, c[f"{q}_len_tokens"])
            c[f"kv_bytes_per_sequence_per_gpu_{q}"] = r["kv_bytes_per_sequence_per_gpu"]
            c[f"safe_concurrency_{q}"] = r.get("safe_concurrency")
        configured = inp.concurrency or c.get("max_concurrency")
        if b and configured:
            # tokens a P99 sequence really occupies: paged, and windowed layers capped
            stored = c["kv_bytes_per_sequence_per_gpu_p99"] / out["kv_bytes_per_token_per_gpu"]
            check = unsafe_concurrency(configured, stored, out["max_kv_tokens"], inp.headroom_frac)
            c["unsafe_concurrency"] = dataclasses.asdict(check)
        out["capture"] = c
    out["levers"] = _levers(inp, at)
    return out


# -- rendering -------------------------------------------------------------------------------
def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _conc(r: dict) -> str:
    if r.get("safe_concurrency") is None:
        return ""
    return f"; fits {r['max_concurrency']:.2f}, safe {r['safe_concurrency']}"


def render_text(p: dict) -> str:
    vb, n = p["kv_bytes_per_value"], p["max_len_tokens"]
    if p["mla_latent_dim"]:
        formula = f"{p['layers']} layers x {p['mla_latent_dim']} latent (one tensor) x {vb:g} B"
    else:
        formula = f"2 x {p['layers']} layers x {p['kv_heads']} KV heads x {p['head_dim']} x {vb:g} B"
    lines = [f"{p['model']}: {p['attention']}, KV {p['kv_dtype']}  (source: {p['model_source']})",
             f"  KV per token     {formula} = {p['kv_bytes_per_token']:,.0f} B ({fmt_bytes(p['kv_bytes_per_token'])})"]
    if p["sliding_layers"]:
        lines.append(f"  sliding window   {p['sliding_layers']} of {p['layers']} layers hold at most "
                     f"{p['sliding_window_tokens']:,} tokens")
    lines.append(f"  KV per sequence  at {n:,} tokens (blocks of {p['block_size_tokens']}): "
                 f"{fmt_bytes(p['kv_bytes_per_sequence'])}")
    if p.get("warning"):
        lines.append(f"  warning: {p['warning']}")
    g = p["gpu"]
    if g is None:
        lines.append("  GPU: unknown (no --gpu-mem and no GPU seen through NVML): capacity not computed")
    else:
        if g["kv_mem_override_bytes"] is not None:
            budget = f"KV memory given: {fmt_bytes(g['kv_budget_bytes_per_gpu'])} per GPU"
        else:
            budget = (f"{fmt_bytes(g['gpu_mem_bytes'])} x {g['mem_util_frac']:g} - weights "
                      f"{fmt_bytes(g['weight_bytes_per_gpu'])} - reserve {fmt_bytes(g['reserve_bytes'])} = "
                      f"KV {fmt_bytes(g['kv_budget_bytes_per_gpu'])} per GPU")
        gpu = g["name"] or (f"of {fmt_bytes(g['gpu_mem_bytes'])}" if g["gpu_mem_bytes"] else "(memory not given)")
        lines += [f"GPU {gpu} x TP {g['tp']}: {budget}",
                  f"  KV tokens that fit  {p['max_kv_tokens']:,} (per-GPU {fmt_bytes(p['kv_bytes_per_token_per_gpu'])}"
                  f"/token)",
                  f"  at {n:,} tokens: fits {p['max_concurrency']:.2f} sequences; safe with "
                  f"{p['headroom_frac']:.0%} headroom: {p['safe_concurrency']}"]
    c = p["capture"]
    if c:
        for q in ("p95", "p99"):
            safe = c.get(f"safe_concurrency_{q}")
            lines.append(f"  capture {q.upper()} length {c[f'{q}_len_tokens']:,} tokens ({c['requests']:,} requests): "
                         f"{fmt_bytes(c[f'kv_bytes_per_sequence_per_gpu_{q}'])}/seq" +
                         (f", safe concurrency {safe}" if safe is not None else ""))
        if c.get("unsafe_concurrency"):
            u = c["unsafe_concurrency"]
            lines.append(f"  {'UNSAFE' if u['unsafe'] else 'ok'}: configured concurrency {u['max_concurrency']} at P99 "
                         f"needs {u['needed_tokens']:,.0f} tokens, {u['usable_tokens']:,.0f} usable")
    lines.append("Levers, in order:")
    for i, lv in enumerate(p["levers"], 1):
        lines.append(f"  {i}. " + _lever_text(lv, p))
    return "\n".join(lines)


def _lever_text(lv: dict, p: dict) -> str:
    kind = lv["lever"]
    if kind == "lower-concurrency":
        if lv.get("requested_concurrency") and "fits" in lv:
            verdict = "fits" if lv["fits"] else f"does not fit: lower it to {lv['safe_concurrency']}"
            return (f"concurrency {lv['requested_concurrency']} needs {fmt_bytes(lv['kv_bytes_needed_per_gpu'])} "
                    f"per GPU of {fmt_bytes(lv['kv_bytes_usable_per_gpu'])} usable: {verdict}")
        if lv["safe_concurrency"] is None:
            return "concurrency: give --gpu-mem to size it"
        return f"keep concurrency at or below {lv['safe_concurrency']} for {p['max_len_tokens']:,}-token requests"
    if kind == "kv-quantisation":
        return (f"KV {lv['kv_dtype']}: {lv['kv_bytes_per_token']:,.0f} B/token, "
                f"{fmt_bytes(lv['kv_bytes_per_sequence_per_gpu'])}/seq" + _conc(lv))
    if kind == "sliding-window":
        head = ("already on" if lv["already"] else "if served with a window (only for models trained with one)")
        return (f"sliding window {lv['window_tokens']:,} tokens on {lv['sliding_layers']} layers, {head}: "
                f"{fmt_bytes(lv['kv_bytes_per_sequence_per_gpu'])}/seq" + _conc(lv))
    parts = [f"{v['attention']}{'*' if v['current'] else ''} {fmt_bytes(v['kv_bytes_per_token'])}/token"
             + (f" safe {v['safe_concurrency']}" if v.get("safe_concurrency") is not None else "")
             for v in lv["variants"]]
    return "attention, same layers and heads (* = this model): " + " | ".join(parts)
