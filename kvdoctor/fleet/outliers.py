"""Fleet comparisons: a replica whose signal is far from its peers' median, where no rule's
absolute threshold fired. Replicas behind one router should look alike; one that does not is
config drift, a sick host or a routing problem, and the peers are the baseline.

Declared in the rules (a rule's ``fleet.outlier``: signal, direction, how far, what it means,
what to check; kvdoctor/schema/rule.schema.json); a replica is an outlier when its value
differs from the median of the *other* replicas by at least ``min_diff`` (in the signal's unit)
and by at least ``min_ratio`` (higher: value >= ratio x median; lower: value <= median / ratio).
At least ``MIN_PEERS`` other replicas must have a value.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .findings import num, replica_list

MIN_PEERS = 2


def _outliers(rules: list) -> list:
    """The rules' fleet outliers, in rule id order."""
    return [r.fleet_outlier for r in sorted(rules, key=lambda r: r.id) if r.fleet_outlier is not None]


def outlier_signals(rules: list) -> list[str]:
    """The signals the rules compare replicas by."""
    return [o.signal for o in _outliers(rules)]


def outlier_findings(values: dict[str, dict[str, float]], rules: list,
                     skip: set[str] = frozenset()) -> list[dict[str, Any]]:
    """``values``: instance -> signal -> value over the range. One finding per rule outlier that
    has outliers, in the same shape as the rule findings (scope replica, kind outlier).
    Instances in ``skip`` (already named by a rule finding) are compared but not reported."""
    out = []
    names = sorted(values)
    for o in _outliers(rules):
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
            "evidence": {n: {o.signal: num(hits[n][0]), "peers_median": num(hits[n][1])} for n in affected},
        })
    return out
