"""`kvdoctor advise`: from a capture's measured phase split, whether chunked prefill, prefill/
decode disaggregation or length tiering would pay, and by how much (ranges, with assumptions).
See docs/advise.md."""
from __future__ import annotations

import math

import numpy as np

from ..engines.labels import ENGINE_KNOB, ENGINE_LABEL
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
    engine = ENGINE_KNOB.get((cap.meta.engine or "").lower())
    tier = options.tiering(w, None)
    if "split_tokens" in tier:
        tier["pools"] = _pools(w, tier["split_tokens"], spec, gpu)
    on_gpu = w.value("gpu_seen") != 0
    result = {
        "capture": str(cap.path), "engine": engine, "requests": split.requests, "busy_s": round(split.busy_s, 3),
        "time_basis": "GPU time" if on_gpu else "compute time",
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
    _engine_limits(result, engine, prep)
    # cheapest first: a flag (chunked prefill), then a second pool behind a router (tiering), then
    # two instance types with a KV transfer between them (disaggregation)
    options_by_cost = [k for k in COST_ORDER if result[k]["verdict"] not in ("not available", "already on")]
    worth = [k for k in options_by_cost if result[k]["verdict"] == "worth it"]
    result["order"] = list(COST_ORDER)
    judged = [result[k]["verdict"] for k in options_by_cost]
    result["summary"] = ("none of the options is worth it on this workload" if judged and all(v == "not worth it" for v in judged)
                         else (f"worth it, cheapest first: {', '.join(LABELS[k] for k in worth)}" if worth
                               else "nothing clearly worth it; see each option"))
    return result


#: the options from cheapest to dearest to put in place
COST_ORDER = ("chunked_prefill", "tiering", "disaggregation")
LABELS = {"chunked_prefill": "chunked prefill", "tiering": "length tiering", "disaggregation": "PD disaggregation"}


def _engine_limits(result: dict, engine: str | None, prep: Prepared) -> None:
    """What the recorded engine cannot do is no verdict (llama.cpp and TGI have no disaggregated
    serving), and what it already does is said as such (chunked prefill at or under the budget)."""
    from ..engines.capabilities import has_feature
    from ..signals.config import effective

    d = result["disaggregation"]
    if engine and has_feature(engine, "pd_disaggregation") is False:
        d["assumptions"].append(f"{ENGINE_LABEL[engine]} has no disaggregated serving")
        d["verdict"], d["reason"] = "not available", (f"{ENGINE_LABEL[engine]} has no disaggregated serving "
                                                     f"(moving to vLLM, SGLang or TensorRT-LLM would be the change)")
    c = result["chunked_prefill"]
    eff = effective(prep)
    on, budget = eff.get("chunked_prefill", (None, ""))[0], eff.get("max_batched_tokens", (None, ""))[0]
    want = (c.get("budget_tokens") or [None, None])[1]
    if on and isinstance(budget, int) and want is not None and c["verdict"] in ("worth it", "may help"):
        where = eff["max_batched_tokens"][1].split(" [", 1)[0]
        if budget <= want:
            c["verdict"] = "already on"
            c["reason"] = f"chunked prefill is on with a {budget:,}-token budget ({where}), within the {want:,.0f} suggested; {c['reason']}"
        else:
            c["reason"] = f"chunked prefill is on with a {budget:,}-token budget ({where}): a smaller one; {c['reason']}"


def _pct(r) -> str:
    if not r or r[0] is None:
        return "?"
    if r[1] is None:
        return f"{r[0]:+.0%} or worse"
    return f"{r[0]:+.0%} to {r[1]:+.0%}"


def render_text(a: dict) -> str:
    basis = a.get("time_basis", "GPU time")
    engine = ENGINE_LABEL.get(a.get("engine") or "", "engine unknown")
    lines = [f"Verdict: {a['summary']}",
             f"kvdoctor advise · {a['capture']} · {engine} · {a['requests']} requests · busy {a['busy_s']:.1f} s",
             f"{basis[0].upper()}{basis[1:]}: prefill {a['prefill_share']:.0%} (range {a['prefill_share_range'][0]:.0%}-"
             f"{a['prefill_share_range'][1]:.0%}), decode {a['decode_share']:.0%}", ""]
    c, d, t = a["chunked_prefill"], a["disaggregation"], a["tiering"]
    lines.append(f"(a) chunked prefill: {c['verdict']} — {c['reason']}")
    if "tpot_change" in c and c["verdict"] != "already on":
        lines.append(f"    stalls {_pct(c['stall_change'])}, TPOT {_pct(c['tpot_change'])}, long-prompt TTFT "
                     f"+{c['ttft_long_added_s'][0]:.3f}-{c['ttft_long_added_s'][1]:.3f} s")
    lines.append(f"(b) length tiering: {t['verdict']} — {t['reason']}")
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
    lines.append(f"(c) PD disaggregation: {d['verdict']} — {d['reason']}")
    if d["verdict"] != "not available":
        lines.append(f"    prefill:decode {basis} {d['prefill_decode_ratio']} (range {d['prefill_decode_ratio_range'][0]}-"
                     f"{d['prefill_decode_ratio_range'][1]}) -> {d['instances']['prefill']} prefill : "
                     f"{d['instances']['decode']} decode instances" + (f", TPOT {_pct(d['tpot_change'])}" if d.get("tpot_change") else ""))
        if d.get("kv_transfer_s_p50_prompt"):
            k = d["kv_transfer_s_p50_prompt"]
            lines.append(f"    KV transfer of a median prompt adds {k[0] * 1e3:.1f}-{k[1] * 1e3:.1f} ms to TTFT")
    lines += ["", "Assumptions and method: docs/advise.md (each option's list is in --format json)."]
    return "\n".join(lines) + "\n"

