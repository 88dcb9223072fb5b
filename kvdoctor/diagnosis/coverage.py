"""What a diagnosis could not judge: the context limit when the capture lacks it, and the rules
that were not evaluated because a signal they need is missing (so "no incident" is never read
as "checked and fine" for a rule that could not fire on this data)."""
from __future__ import annotations

from dataclasses import dataclass

from ..signals import Prepared, Window
from . import conditions as C
from .rules import Rule

#: config keys the context_limit_tokens signal reads (signals/memory.py), first found wins
_LIMIT_KEYS = ("context_len_tokens", "max_model_len", "context_length", "n_ctx")

_LIMIT = "the context limit: pass --max-model-len"
_KV_USE = "KV cache usage (engine /metrics)"
_MEM = "GPU or server memory samples over time (NVML, DCGM or host)"
_TURNS = "conversation turns (session and turn per request)"
_PREFIX = "prefix block hashes per request"
_LAT = "per-request latencies"
_ARRIVALS = "request send times (arrivals), which this source lacks"
#: signals that are unknown when a *source* is absent from the capture (not when the workload
#: merely lacks a pattern, e.g. no long prompts for hol_ttft_ratio), with what to supply
SOURCE_NEEDS = {
    "context_limit_tokens": _LIMIT, "prompt_p99_over_limit": _LIMIT,
    "kv_usage_p50_frac": _KV_USE, "kv_usage_max_frac": _KV_USE, "kv_full_forecast_min": _KV_USE,
    "kv_usage_over_token_demand": _KV_USE, "kv_growth_frac_per_min": _KV_USE,
    "preemptions_per_min": "the engine's preemption counter (/metrics)",
    "kv_capacity_tokens": "the KV cache size and the concurrency limit (engine config or /metrics)",
    "kv_demand_over_capacity": "the KV cache size and the concurrency limit (engine config or /metrics)",
    "max_concurrency_configured": "the concurrency limit (engine config)",
    "gpu_mem_growth_mib_per_h": _MEM, "gpu_mem_growth_corr": _MEM,
    "server_rss_growth_mib_per_h": _MEM, "server_rss_growth_corr": _MEM,
    "mem_bw_util_p90": "GPU memory-bandwidth samples (NVML or DCGM)",
    "kv_dtype_quantised": "the KV cache type (engine config)",
    "turn_max": _TURNS, "context_tokens_per_turn": _TURNS,
    "prefix_hit_rate_achievable": _PREFIX, "prefix_hit_gap": _PREFIX,
    "requests_waiting_p50": "the engine's waiting-queue gauge (/metrics)",
    "queue_share_p50": "queue time per request",
    "concurrency_max": "request send times (arrivals)",
    "e2e_p99_over_p50": _LAT, "ttft_p99_over_p50": _LAT, "tpot_p99_over_p50": _LAT,
    **{name: _ARRIVALS for name in ("ttft_over_low_load", "tpot_over_low_load", "ttft_low_load_p50_s",
                                    "tpot_low_load_p50_s", "inflight_over_littles_law", "arrivals_over_completions",
                                    "ttft_late_over_early", "ttft_wait_p90_s", "ttft_unloaded_p90_s",
                                    "prefill_ms_per_1k_tokens_low_load", "request_rate_per_s")},
}


@dataclass(frozen=True)
class NotEvaluated:
    rule: str
    #: the source signals whose absence keeps the rule from ever firing here, in rule order
    missing: tuple[str, ...]
    #: what to supply, one line each (several signals may need the same source)
    needs: tuple[str, ...]

    def text(self) -> str:
        return f"{self.rule} (needs {'; '.join(self.needs)})"

    def to_json(self) -> dict:
        return {"rule": self.rule, "missing": list(self.missing), "needs": list(self.needs)}


def not_evaluated_line(items: list[NotEvaluated]) -> str | None:
    """One line for the text outputs, rules grouped by what they need."""
    if not items:
        return None
    groups: dict[tuple[str, ...], list[str]] = {}
    for n in items:
        groups.setdefault(n.needs, []).append(n.rule)
    return "not evaluated: " + "; ".join(f"{', '.join(ids)} (needs {'; '.join(needs)})" for needs, ids in groups.items())


def context_limit(prep: Prepared, max_model_len_tokens: float | None) -> tuple[float | None, str, list[str]]:
    """(limit, where it came from, warnings), filling prep.config when the capture lacks one.

    Engine info in the capture wins (it is what the server ran with); else --max-model-len;
    else the model table (kvdoctor/plan/models.py): the model's max_position_embeddings, which
    is vLLM's default --max-model-len.
    """
    have = next((float(prep.config[k]) for k in _LIMIT_KEYS
                 if isinstance(prep.config.get(k), (int, float)) and prep.config[k] > 0), None)
    if have is not None:
        warn = []
        if max_model_len_tokens and max_model_len_tokens != have:
            warn.append(f"--max-model-len {max_model_len_tokens:,.0f} ignored: the capture's engine reports "
                        f"a context limit of {have:,.0f} tokens")
        return have, "engine info in the capture", warn
    if max_model_len_tokens:
        prep.config["max_model_len"] = float(max_model_len_tokens)
        return float(max_model_len_tokens), "--max-model-len", []
    spec = _model_spec(prep.meta.model)
    if spec is not None and spec.max_position_embeddings:
        prep.config["max_model_len"] = float(spec.max_position_embeddings)
        return (float(spec.max_position_embeddings),
                f"the model table: {spec.name}'s max_position_embeddings (vLLM's default --max-model-len; "
                "pass --max-model-len if the server ran with less)", [])
    return None, "", []


def _model_spec(name: str | None):
    if not name:
        return None
    from ..errors import InputError
    from ..plan.models import builtin_model

    try:
        return builtin_model(name)
    except InputError:  # not a model the table knows: no limit from it
        return None


def not_evaluated(w: Window, rules: list[Rule], fired: set[str], slo: dict[str, float]) -> list[NotEvaluated]:
    """Rules that did not fire and could not have on this capture: too few requests for their
    minimum, or every way their symptom could hold needs a source the capture lacks.

    A signal some evaluated window knew is known (the rules were judged on it there) and is not
    computed again on the whole capture: on a million requests that cost ~0.5 s."""
    known = w.prep.memo.get("known_signals", set())

    def value(name: str) -> float:  # for can_hold, which asks only known or not: 0.0 stands for "known"
        return 0.0 if name in known else w.value(name)

    out = []
    for rule in rules:
        if rule.id in fired:
            continue
        if w.n_requests < rule.min_requests:
            out.append(NotEvaluated(rule.id, (), (f"at least {rule.min_requests} requests; has {w.n_requests}",)))
            continue
        if not rule.when.signals() & SOURCE_NEEDS.keys():
            continue  # none of its signals stands for a source: whatever it lacks, it is not listed (below)
        if C.can_hold(rule.when, value, slo):
            continue
        missing = tuple(m for m in C.unknown_signals(rule.when, w.value, slo, rule.params) if m in SOURCE_NEEDS)
        needs = tuple(dict.fromkeys(SOURCE_NEEDS[m] for m in missing))
        if needs:  # else the workload lacks the pattern (not applicable), not the capture a source
            out.append(NotEvaluated(rule.id, missing, needs))
    return out
