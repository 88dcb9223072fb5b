"""Fleet comparisons: a replica whose signal is far from its peers' median, where no rule's
absolute threshold fired. Replicas behind one router should look alike; one that does not is
config drift, a sick host or a routing problem, and the peers are the baseline.

Declared as a table (signal, direction, how far, what it means, what to check); a replica is an
outlier when its value differs from the median of the *other* replicas by at least ``min_diff``
(in the signal's unit) and by at least ``min_ratio`` (higher: value >= ratio x median; lower:
value <= median / ratio). At least ``MIN_PEERS`` other replicas must have a value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

MIN_PEERS = 2


@dataclass(frozen=True)
class Outlier:
    signal: str
    direction: str  # "high" | "low"
    min_diff: float
    min_ratio: float
    meaning: str
    check: str


OUTLIERS: tuple[Outlier, ...] = (
    Outlier("prefix_hit_rate_achieved", "low", 0.2, 2.0,
            "serves far fewer prompt tokens from its prefix cache than its peers",
            "prefix caching off on this replica (vLLM --enable-prefix-caching, SGLang radix cache, "
            "llama.cpp cache_prompt), a smaller cache, or the router no longer keeps prefixes together"),
    Outlier("ttft_p99_s", "high", 0.5, 2.0, "has a much slower TTFT tail than its peers",
            "its queue (requests waiting), its prompt lengths, and its engine flags against a healthy replica"),
    Outlier("tpot_p99_s", "high", 0.01, 1.5, "decodes much slower than its peers",
            "GPU clocks, temperature and power limits (DCGM), noisy neighbours, batch size"),
    Outlier("error_rate", "high", 0.02, 3.0, "fails far more requests than its peers",
            "its logs and restarts; a bad node or a replica left on an old config"),
    Outlier("kv_usage_p50_frac", "high", 0.3, 1.5, "holds much more KV cache than its peers",
            "longer sequences routed to it, or a smaller KV pool (gpu-memory-utilization / --mem-fraction-static drift)"),
)


def replica_list(items: list[str], most: int = 5) -> str:
    """Replicas for a sentence (findings' summaries, here and in fleet.py): all of them when
    few, else the first few and a count; the JSON's ``instances``/``healthy`` keep every name."""
    if len(items) <= most:
        return ", ".join(items)
    return f"{', '.join(items[:most])} and {len(items) - most} more"


def _num(v: float) -> float | None:
    return None if v is None or not math.isfinite(v) else round(float(v), 4)


def outlier_findings(values: dict[str, dict[str, float]], skip: set[str] = frozenset()) -> list[dict[str, Any]]:
    """``values``: instance -> signal -> value over the range. One finding per table entry that
    has outliers, in the same shape as the rule findings (scope replica, kind outlier).
    Instances in ``skip`` (already named by a rule finding) are compared but not reported."""
    out = []
    names = sorted(values)
    for o in OUTLIERS:
        vals = {n: values[n].get(o.signal, math.nan) for n in names}
        hits: dict[str, tuple[float, float]] = {}
        for n, v in vals.items():
            peers = [p for m, p in vals.items() if m != n and math.isfinite(p)]
            if not math.isfinite(v) or len(peers) < MIN_PEERS:
                continue
            med = float(np.median(peers))
            if o.direction == "high":
                far = v - med >= o.min_diff and v >= o.min_ratio * med
            else:
                far = med - v >= o.min_diff and v * o.min_ratio <= med
            if far and n not in skip:
                hits[n] = (v, med)
        if not hits or len(hits) * 2 > len(names):  # most replicas "outlying" means no baseline
            continue
        affected = sorted(hits)
        out.append({
            "rule": f"outlier:{o.signal}", "title": f"One replica {o.meaning}", "severity": "warning",
            "scope": "replica", "kind": "outlier", "instances": affected,
            "healthy": [n for n in names if n not in hits],
            "summary": f"{replica_list(affected)} {o.meaning} ({o.signal} "
                       + ", ".join(f"{hits[n][0]:.3g} vs peers' median {hits[n][1]:.3g}" for n in affected[:5])
                       + f"): check {o.check}",
            "evidence": {n: {o.signal: _num(hits[n][0]), "peers_median": _num(hits[n][1])} for n in affected},
        })
    return out
