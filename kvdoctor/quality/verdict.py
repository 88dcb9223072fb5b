"""The verdict: per prompt-length bucket, agreement and repetition of baseline vs candidate,
judged with the kv-quant-quality rule's margins."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..diagnosis.rules import builtin_params
from .probe import Comparison


def by_context(results: list[Comparison], buckets: int = 4) -> list[dict[str, Any]]:
    """Per prompt-length bucket: median agreement and repetition, baseline vs candidate."""
    lengths = np.array([r.prompt_tokens or 0 for r in results], dtype=float)
    edges = np.unique(np.quantile(lengths, np.linspace(0, 1, buckets + 1)))
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = [r for r, L in zip(results, lengths) if lo <= L <= hi]
        if not sel:
            continue

        def med(xs):
            xs = [x for x in xs if x is not None]
            return float(np.median(xs)) if xs else None

        rows.append({"prompt_tokens_from": int(lo), "prompt_tokens_to": int(hi), "prompts": len(sel),
                     "agreement_p50": med([r.agreement_frac for r in sel]),
                     "forced_agreement_p50": med([r.forced_agreement_frac for r in sel]),
                     "baseline_repetition_p50": med([r.baseline_repetition for r in sel]),
                     "candidate_repetition_p50": med([r.candidate_repetition for r in sel])})
    return rows


def verdict(rows: list[dict[str, Any]], params: dict[str, float] | None = None,
            results: list[Comparison] | None = None) -> str:
    """Degraded when, teacher-forced over the baseline's own continuations (``results``), the
    candidate picks another next token than the baseline at more positions than the rule allows
    (median under ``min_forced_agreement``); or, at the longest contexts, it repeats itself much
    more than the baseline; or, without the teacher-forced measure, its free-running output stops
    agreeing with the baseline's much earlier than at the shortest contexts. The margins are the
    kv-quant-quality rule's, so this verdict and `kvdoctor diagnose` on the --capture judge alike;
    ``params`` overrides them."""
    if not rows:
        return "no data"
    p = {**builtin_params("kv-quant-quality"), **(params or {})}
    long_, short = rows[-1], rows[0]
    rep_gap = (long_["candidate_repetition_p50"] or 0) - (long_["baseline_repetition_p50"] or 0)
    forced = [r.forced_agreement_frac for r in results or () if r.forced_agreement_frac is not None]
    if forced:
        f50 = float(np.median(forced))
        if f50 < p["min_forced_agreement"] or rep_gap >= p["min_repetition_gap"]:
            return (f"DEGRADED: teacher-forced, the candidate picks the baseline's next token at {f50:.1%} of positions "
                    f"(median of {len(forced)} prompts; below {p['min_forced_agreement']:.0%} is degraded); extra repetition "
                    f"at long context {rep_gap:+.2f}")
        return (f"no degradation beyond the rule's margins: teacher-forced, the candidate picks the baseline's next token "
                f"at {f50:.1%} of positions (median of {len(forced)} prompts)")
    agree_drop = (short["agreement_p50"] or 0) - (long_["agreement_p50"] or 0)
    if rep_gap >= p["min_repetition_gap"] or agree_drop >= p["min_agreement_drop"]:
        return (f"DEGRADED at long context: candidate repetition {long_['candidate_repetition_p50']:.2f} vs baseline "
                f"{long_['baseline_repetition_p50']:.2f}; agreement {long_['agreement_p50']:.2f} vs {short['agreement_p50']:.2f} at short context")
    return "no degradation beyond noise"
