"""What each fix would buy on this workload, as ranges with their assumptions.

Inputs are the capture's own measurements: the phase split (phases.py), the decode gaps that
overlap other requests' prefills (signals/interference.py) and the short/long request split
that the head-of-line signals use. Each option returns a dict with a ``verdict`` ("worth it",
"may help", "not worth it" or "unknown"), the reason, the estimated changes as
``[low, high]`` ranges (fractions: -0.3 = 30% lower) and its ``assumptions``.
"""
from __future__ import annotations

import math

import numpy as np

from ..numeric import json_number
from ..signals import Window
from ..signals.interference import window_gaps
from .phases import PhaseSplit, instance_split

#: stall share at which a fix is worth its cost: prefills add half again to decode time
#: (TPOT 1.5x what decode alone gives), the same line as the prefill-decode-interference rule
WORTH_STALL_SHARE = 1 / 3
#: below this share of decode time prefills' stalls are noise against a shared host's jitter
MINOR_STALL_SHARE = 0.1
#: engines (capture meta.engine) with no prefill/decode disaggregation of their own
NO_DISAGGREGATION_ENGINES = ("llamacpp", "tgi")  # kvdoctor/engines/capabilities.py is the source; a test keeps them equal
#: chunk budgets (tokens of prefill per step) the estimate spans when today's chunk is larger:
#: vLLM's default 2048 for chunked prefill down to 512, the range Sarathi-Serve evaluates
CHUNK_BUDGETS_TOKENS = (512, 2048)
#: KV transfer bandwidth between prefill and decode instances (bytes/s): 25 GB/s (PCIe 4 x16
#: or a 200 Gb/s NIC) to 300 GB/s (NVLink within a node)
KV_LINK_BYTES_PER_S = (25e9, 300e9)


def _r(x: float, nd: int = 3) -> float | None:
    return None if x is None else json_number(float(x), nd)  # float: whole numbers stay 512.0 in JSON


def _rng(lo: float, hi: float, nd: int = 3) -> list:
    a, b = sorted((lo, hi))
    return [_r(a, nd), _r(b, nd)]


def stall_figures(w: Window) -> dict:
    """Decode-gap figures: plain step, stall share, the largest stalls, prefill cost seen by a
    decode stream per token; empty without per-request ITL."""
    g = window_gaps(w)
    if g is None:
        return {}
    hit = g.prefill_tokens > 0
    plain = g.gap_s[~hit] if (~hit).sum() >= 5 else g.gap_s
    return {"step_p50_s": float(np.median(plain)),
            "itl_p99_s": float(np.percentile(g.gap_s, 99)),
            # the stalls themselves: a few long prefills hide below an ITL P99 of thousands of gaps
            "stall_p90_s": float(np.percentile(g.gap_s[hit], 90)) if hit.any() else float("nan"),
            "stall_share": w.value("itl_prefill_stall_share"),
            "stall_corr": w.value("itl_prefill_stall_corr"),
            "stall_s_per_token": w.value("itl_prefill_stall_ms_per_1k_tokens") / 1e6,
            "gaps": int(len(g.gap_s)), "gaps_overlapping_prefill": int(hit.sum()),
            # prefill tokens a stalled step carries today: the engine's effective chunk
            "chunk_tokens_now": float(np.percentile(g.prefill_tokens[hit], 90)) if hit.any() else 0.0}


def stall_with_budget_s(step_s: float, cost_s_per_token: float, budget_tokens: float, stall_now_s: float) -> float:
    """A stalled decode gap under a prefill budget of `budget_tokens` per step: the plain step plus
    the budget's prefill at the cost per token decode gaps show today, never more than today's.
    Checked against a real vLLM pair (tests/test_advise.py: unchunked -> 256-token budget)."""
    return min(step_s + budget_tokens * cost_s_per_token, stall_now_s) if math.isfinite(cost_s_per_token) else stall_now_s


def chunked_prefill(split: PhaseSplit, st: dict, prompt_p99_tokens: float, on_cpu: bool = False) -> dict:
    """A per-step prefill budget C: a stall is at most C tokens' prefill; a prompt of P tokens
    then takes ceil(P / C) steps, each also running the decodes. C spans 512-2048 where the
    prefill tokens a stalled gap carries now (its P90) exceed that, else a half to a quarter of
    today's chunk (the engine already chunks: only a smaller budget shortens the stalls)."""
    assumptions = [
        "a step carrying a chunk lasts the plain decode step plus the chunk's prefill, at the prefill cost per "
        "token that decode gaps show (the slope of stall on prefill tokens inside the gap)",
        "the prefill work itself is unchanged: mean TPOT falls only by what piggybacking decodes on "
        "compute-bound chunks saves (up to the whole stall on a GPU, nothing on a CPU-bound server)",
        "TTFT of a long prompt grows by one decode step per extra chunk",
    ]
    if not st:
        return {"verdict": "unknown", "reason": "the capture has no per-request inter-token times "
                "(record through kvdoctor attach's proxy) to measure stalls with", "assumptions": assumptions}
    cost = st["stall_s_per_token"]
    if not math.isfinite(cost) or cost <= 0:
        cost = split.prefill_cost_s_per_token
    share, step, p99, chunk_now = st["stall_share"], st["step_p50_s"], st["stall_p90_s"], st["chunk_tokens_now"]
    if chunk_now > CHUNK_BUDGETS_TOKENS[1]:
        budgets = CHUNK_BUDGETS_TOKENS
    else:
        budgets = (max(chunk_now / 4, 16), max(chunk_now / 2, 32))
    assumptions.append(f"budget C from {budgets[0]:.0f} to {budgets[1]:.0f} tokens per step (today's stalled gaps "
                       f"carry up to ~{chunk_now:.0f})")
    itl_after = [stall_with_budget_s(step, cost, c, p99) for c in budgets]
    longest = prompt_p99_tokens if math.isfinite(prompt_p99_tokens) else 0.0
    ttft_extra = [max(math.ceil(longest / c) - math.ceil(longest / max(chunk_now, 1)), 0) * step for c in budgets]
    out = {
        "chunk_tokens_now": _r(chunk_now, 0), "budget_tokens": _rng(*budgets, 0),
        "stall_p90_s_now": _r(p99, 4),
        "stall_p90_s_after": _rng(itl_after[0], itl_after[1], 4),
        "stall_change": _rng(itl_after[0] / p99 - 1, itl_after[1] / p99 - 1),
        "tpot_change": _rng(-share, 0.0),
        "ttft_long_added_s": _rng(ttft_extra[1], ttft_extra[0], 4),
        "assumptions": assumptions,
    }
    if on_cpu and share >= MINOR_STALL_SHARE:
        # measured (docs/advise.md): llama.cpp on 2 CPU threads at -b 128 paid 3.4x the prefill cost
        # per token of -b 2048; stalls halved but TTFT and TPOT tripled
        out["tpot_change"] = [0.0, None]
        assumptions.append("on a CPU server a smaller batch raises the prefill cost per token: expect shorter "
                           "stalls but TTFT and TPOT no better, possibly much worse")
        verdict, why = "may help", (f"prefills' stalls are {share:.0%} of decode time, but the server has no GPU: "
                                    "a smaller prefill batch shortens each stall and lowers CPU prefill throughput")
    elif share >= WORTH_STALL_SHARE:
        verdict, why = "worth it", (f"prefills' stalls are {share:.0%} of decode time; a {budgets[0]:.0f}-{budgets[1]:.0f}"
                                    f"-token budget caps each stall near {itl_after[0] * 1e3:.0f}-"
                                    f"{itl_after[1] * 1e3:.0f} ms (P90 of stalls now {p99 * 1e3:.0f} ms)")
    elif share >= MINOR_STALL_SHARE:
        verdict, why = "may help", f"prefills' stalls are {share:.0%} of decode time: the ITL tail shrinks, TPOT little"
    else:
        verdict, why = "not worth it", f"prefills' stalls are {share:.0%} of decode time"
    return {"verdict": verdict, "reason": why, **out}


def disaggregation(split: PhaseSplit, st: dict, kv_bytes_per_token: float | None, prompt_p50_tokens: float,
                   tpot_corr: float | None = None) -> dict:
    """Separate prefill and decode instances: decode steps carry no prefill; each request's KV
    travels from its prefill instance to its decode instance."""
    r_lo, r_mid, r_hi = split.ratio()
    p_share = split.share("prefill")
    assumptions = [
        "instance ratio = prefill GPU time : decode GPU time, both at the capture's batch sizes (a decode "
        "instance that batches more needs fewer instances)",
        f"KV moves at {KV_LINK_BYTES_PER_S[0] / 1e9:.0f}-{KV_LINK_BYTES_PER_S[1] / 1e9:.0f} GB/s (PCIe/network "
        "to NVLink), once per request, before its first decode",
        "TPOT without prefills in the steps = today's TPOT minus the measured stall share",
        "needs at least two instances (GPUs or nodes) and an engine that supports it (vLLM, SGLang, TensorRT-LLM)",
    ]
    out: dict = {
        "prefill_decode_ratio": _r(r_mid), "prefill_decode_ratio_range": _rng(r_lo, r_hi),
        "instances": dict(zip(("prefill", "decode"), instance_split(r_mid))),
        "assumptions": assumptions,
    }
    if kv_bytes_per_token and math.isfinite(prompt_p50_tokens):
        kv = prompt_p50_tokens * kv_bytes_per_token
        out["kv_transfer_s_p50_prompt"] = _rng(kv / KV_LINK_BYTES_PER_S[1], kv / KV_LINK_BYTES_PER_S[0], 5)
    else:
        out["kv_transfer_s_p50_prompt"] = None
        assumptions.append("KV transfer time unknown: give --model to size the KV per token")
    share = st.get("stall_share", float("nan"))
    if math.isfinite(share):
        out["tpot_change"] = _rng(-share, -share / 2)
    lopsided = p_share[1] < 0.05 or p_share[1] > 0.95
    if not st:
        corr = tpot_corr if tpot_corr is not None else float("nan")
        hint = (f"; per request, TPOT does rise with the prompt tokens prefilled during its decode (rank corr "
                f"{corr:.2f})" if math.isfinite(corr) and corr >= 0.3 else "")
        verdict, why = "unknown", ("no per-request inter-token times: the interference it removes cannot be sized"
                                   + hint + "; record through kvdoctor attach's proxy")
    elif share >= WORTH_STALL_SHARE and not lopsided:
        verdict, why = "worth it", (f"prefills' stalls are {share:.0%} of decode time and both phases carry real work "
                                    f"(prefill {p_share[1]:.0%} of busy time); try chunked prefill first, it is cheaper")
    elif lopsided:
        verdict, why = "not worth it", (f"prefill is {p_share[1]:.0%} of busy time: one pool would sit idle "
                                        "(decode-dominated or prefill-dominated traffic)")
    else:
        verdict, why = "not worth it", f"prefills' stalls are {share:.0%} of decode time: little to remove"
    return {"verdict": verdict, "reason": why, **out}


def tiering(w: Window, pools: dict | None) -> dict:
    """Two pools split by prompt length at max(4 x median, P90): short requests no longer wait
    for or decode beside the long minority."""
    p = w.r("prompt_tokens")
    p = p[np.isfinite(p)]
    assumptions = [
        "split at max(4 x median prompt, P90): the long minority of the head-of-line signals",
        "short requests in their own pool get the TTFT/TPOT the capture's short requests had with no long one in "
        "flight (low end) or keep today's (high end)",
        "each pool's KV sized by kvdoctor plan for its own P99 length (with --model and --gpu-mem)",
        "the long pool takes the long requests' share of the prompt tokens (prefill work grows with them): give it "
        "that share of the instances, or its own prefills will stall its decodes and queue its requests",
    ]
    if len(p) < 20:
        return {"verdict": "unknown", "reason": "fewer than 20 requests with prompt lengths", "assumptions": assumptions}
    med = float(np.median(p))
    split_tokens = int(max(4 * med, float(np.percentile(p, 90))))  # whole tokens: ties fall on the long side
    long_frac = float(np.mean(p >= split_tokens))
    long_token_share = float(p[p >= split_tokens].sum() / p.sum()) if p.sum() > 0 else float("nan")
    tail = w.value("prompt_p99_over_p50")
    hol, tpot_r = w.value("hol_ttft_ratio"), w.value("short_tpot_long_inflight_ratio")
    out = {"split_tokens": int(split_tokens), "long_frac": _r(long_frac), "long_prompt_token_share": _r(long_token_share),
           "prompt_p99_over_p50": _r(tail),
           "short_ttft_long_inflight_ratio": _r(hol), "short_tpot_long_inflight_ratio": _r(tpot_r),
           "short_ttft_change": _rng(1 / hol - 1, 0.0) if math.isfinite(hol) and hol > 1 else [0.0, 0.0],
           "short_tpot_change": _rng(1 / tpot_r - 1, 0.0) if math.isfinite(tpot_r) and tpot_r > 1 else [0.0, 0.0],
           "pools": pools, "assumptions": assumptions}
    hurt = (math.isfinite(hol) and hol >= 2) or (math.isfinite(tpot_r) and tpot_r >= 1.5)
    if not math.isfinite(tail) or tail < 4:
        verdict, why = "not worth it", "prompt lengths have no heavy tail (P99 under 4x the median)"
    elif hurt:
        verdict, why = "worth it", (f"{long_frac:.0%} of requests are {int(split_tokens):,}+ tokens and short requests "
                                    "are slower while one is in flight")
    elif not (math.isfinite(hol) or math.isfinite(tpot_r)):
        verdict, why = "unknown", "too few short requests overlapped a long one to compare"
    else:
        verdict, why = "not worth it", "short requests are not measurably slower beside long ones"
    return {"verdict": verdict, "reason": why, **out}
