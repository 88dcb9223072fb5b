"""`kvdoctor advise`: from a capture's measured phase split, whether chunked prefill, prefill/
decode disaggregation or length tiering would pay, and by how much (ranges, with assumptions).
See docs/advise.md."""
from __future__ import annotations

import math

import numpy as np

from ..errors import InputError
from ..signals import Prepared, Window
from . import options
from .phases import PhaseSplit, measure

__all__ = ["advise", "render_text", "PhaseSplit", "measure"]


def _pools(w: Window, split_tokens: int, spec, gpu) -> dict | None:
    """Each tier's P99 length (prompt + output) and the concurrency its KV holds (kvdoctor plan)."""
    if spec is None:
        return None
    from ..plan import kvmodel as km
    from ..plan.planner import weight_bytes

    total = w.r("prompt_tokens") + np.nan_to_num(w.r("output_tokens"))
    prompt = w.r("prompt_tokens")
    dtype = km.kv_dtype("fp16" if spec.weight_dtype == "fp16" else "bf16")
    budget = km.GpuBudget(gpu_mem_bytes=gpu[1], weight_bytes=weight_bytes(spec)) if gpu else None
    out = {}
    for name, m in (("short", prompt < split_tokens), ("long", prompt >= split_tokens)):
        t = total[m & np.isfinite(total)]
        if not len(t):
            continue
        p99 = int(math.ceil(np.percentile(t, 99)))
        row = {"requests": int(len(t)), "p99_len_tokens": p99,
               "kv_bytes_per_sequence": km.kv_bytes_per_sequence(spec, dtype, p99)}
        if budget is not None and budget.kv_budget_bytes_per_gpu > 0:
            row["max_concurrency"] = km.max_concurrency(spec, dtype, budget, p99)
            row["safe_concurrency"] = km.safe_concurrency(spec, dtype, budget, p99)
        out[name] = row
    return out


def advise(cap, model: str | None = None, gpu_mem: str | None = None) -> dict:
    """The advice as a JSON-ready dict (docs/advise.md lists the fields)."""
    prep = Prepared(cap)
    if not len(cap.requests):
        raise InputError(f"{cap.path}: no request records; advise needs per-request times "
                         "(record with kvdoctor attach, or import a benchmark's per-request file)")
    w = Window(prep, prep.start_s, prep.end_s)
    split = measure(prep, w)
    if split is None or split.busy_s <= 0:
        raise InputError(f"{cap.path}: requests lack arrival, first-token or finish times; advise needs all "
                         "three to split prefill from decode")
    spec = gpu = None
    kv_tok = None
    if model:
        from ..plan import kvmodel as km
        from ..plan.models import resolve_model
        from ..plan.planner import resolve_gpu

        spec = resolve_model(model)
        kv_tok = km.kv_bytes_per_token(spec, km.kv_dtype("fp16" if spec.weight_dtype == "fp16" else "bf16"))
        gpu = resolve_gpu(gpu_mem) if gpu_mem else None
    st = options.stall_figures(w)
    p_lo, p_mid, p_hi = split.share("prefill")
    if cap.meta.engine in options.NO_DISAGGREGATION_ENGINES:
        result_note = (f"{cap.meta.engine} has no disaggregated serving: moving to vLLM, SGLang or TensorRT-LLM "
                       "is part of its cost")
    else:
        result_note = None
    tier = options.tiering(w, None)
    if "split_tokens" in tier:
        tier["pools"] = _pools(w, tier["split_tokens"], spec, gpu)
    result = {
        "capture": str(cap.path), "requests": split.requests, "busy_s": round(split.busy_s, 3),
        "prefill_share": round(p_mid, 4), "decode_share": round(1 - p_mid, 4),
        "prefill_share_range": options._rng(p_lo, p_hi, 4),
        "prefill_gpu_s": round(split.prefill_gpu_s[1], 3), "decode_gpu_s": round(split.decode_gpu_s[1], 3),
        "prefill_cost_ms_per_1k_tokens": options._r(split.prefill_cost_s_per_token * 1e6, 1),
        "decode_streams_mean": options._r(split.decode_streams_mean, 2),
        "stalls": {k: (options._r(v, 5) if isinstance(v, float) else v) for k, v in st.items()} or None,
        "chunked_prefill": options.chunked_prefill(split, st, w.value("prompt_p99_tokens"),
                                                   on_cpu=w.value("gpu_seen") == 0),
        "disaggregation": options.disaggregation(split, st, kv_tok, w.value("prompt_p50_tokens"),
                                                 w.value("tpot_prefill_interference_corr")),
        "tiering": tier,
    }
    if result_note:
        result["disaggregation"]["assumptions"].append(result_note)
        if result["disaggregation"]["verdict"] == "worth it":
            result["disaggregation"]["reason"] += f" ({result_note})"
    worth = [k for k in ("chunked_prefill", "disaggregation", "tiering") if result[k]["verdict"] == "worth it"]
    result["summary"] = ("none of the three is worth it on this workload" if not worth and all(
        result[k]["verdict"] == "not worth it" for k in ("chunked_prefill", "disaggregation", "tiering"))
        else ("worth it: " + ", ".join(worth) if worth else "nothing clearly worth it; see each option"))
    return result


def _pct(r) -> str:
    if not r or r[0] is None:
        return "?"
    if r[1] is None:
        return f"{r[0]:+.0%} or worse"
    return f"{r[0]:+.0%} to {r[1]:+.0%}"


def render_text(a: dict) -> str:
    lines = [f"kvdoctor advise · {a['capture']} · {a['requests']} requests · busy {a['busy_s']:.1f} s",
             f"GPU time: prefill {a['prefill_share']:.0%} (range {a['prefill_share_range'][0]:.0%}-"
             f"{a['prefill_share_range'][1]:.0%}), decode {a['decode_share']:.0%}",
             f"Verdict: {a['summary']}", ""]
    c, d, t = a["chunked_prefill"], a["disaggregation"], a["tiering"]
    lines.append(f"(a) chunked prefill: {c['verdict']} — {c['reason']}")
    if "tpot_change" in c:
        lines.append(f"    stalls {_pct(c['stall_change'])}, TPOT {_pct(c['tpot_change'])}, long-prompt TTFT "
                     f"+{c['ttft_long_added_s'][0]:.3f}-{c['ttft_long_added_s'][1]:.3f} s")
    lines.append(f"(b) PD disaggregation: {d['verdict']} — {d['reason']}")
    lines.append(f"    prefill:decode GPU time {d['prefill_decode_ratio']} (range {d['prefill_decode_ratio_range'][0]}-"
                 f"{d['prefill_decode_ratio_range'][1]}) -> {d['instances']['prefill']} prefill : "
                 f"{d['instances']['decode']} decode instances" + (f", TPOT {_pct(d['tpot_change'])}" if d.get("tpot_change") else ""))
    if d.get("kv_transfer_s_p50_prompt"):
        k = d["kv_transfer_s_p50_prompt"]
        lines.append(f"    KV transfer of a median prompt adds {k[0] * 1e3:.1f}-{k[1] * 1e3:.1f} ms to TTFT")
    lines.append(f"(c) length tiering: {t['verdict']} — {t['reason']}")
    if "split_tokens" in t:
        lines.append(f"    split at {t['split_tokens']:,} prompt tokens ({t['long_frac']:.0%} long); short TTFT "
                     f"{_pct(t['short_ttft_change'])}, short TPOT {_pct(t['short_tpot_change'])}")
        if t.get("long_prompt_token_share") is not None:
            lines.append(f"    the long {t['long_frac']:.0%} carry {t['long_prompt_token_share']:.0%} of the prompt tokens: "
                         "size the long pool for that share of the prefill work")
        for name, p in (t.get("pools") or {}).items():
            conc = f", {p['safe_concurrency']} safe concurrent" if "safe_concurrency" in p else ""
            lines.append(f"    {name} pool: P99 {p['p99_len_tokens']:,} tokens, "
                         f"{p['kv_bytes_per_sequence'] / 2**20:.0f} MiB KV per sequence{conc}")
    lines += ["", "Assumptions and method: docs/advise.md (each option's list is in --format json)."]
    return "\n".join(lines) + "\n"
