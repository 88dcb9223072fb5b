"""Fleet findings from the rules: per rule that fired on any replica, whether it is one
replica's problem (imbalance, when that replica also takes clearly more load than the others,
else a sick host) or every replica's. What "every replica" means is the rule's own word (its
``fleet.on_every_replica``: capacity, or a cause the replicas share) and its cause's title."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from ..numeric import json_number

#: affected replicas taking this many times the healthy ones' median load: the router's fault
IMBALANCE_RATIO = 1.5

#: what a rule firing on every replica means, by the rule's ``fleet.on_every_replica``
EVERYWHERE = {
    "capacity": "the fleet as a whole lacks capacity (add replicas or shed load)",
    "shared": "the same on every replica, so a cause they share (model, configuration or workload), not one host",
}


def num(v: float) -> float | None:
    """A finding's number for JSON: to 4 decimals, None when unknown."""
    return json_number(v, 4)


def replica_list(items: list[str], most: int = 5) -> str:
    """Replicas for a sentence (findings' summaries, the text report): all of them when few,
    else the first few and a count; the JSON's ``instances``/``healthy`` keep every name."""
    if len(items) <= most:
        return ", ".join(items)
    return f"{', '.join(items[:most])} and {len(items) - most} more"


def _some(rid: str, affected: list[str], healthy: list[str], load: dict[str, float]) -> tuple[str, str]:
    """(kind, summary) of a rule that fired on some replicas: imbalance or sick host."""
    la = np.nanmedian([load.get(n, np.nan) for n in affected]) if affected else np.nan
    lh = np.nanmedian([load.get(n, np.nan) for n in healthy]) if healthy else np.nan
    ratio = la / lh if math.isfinite(la) and math.isfinite(lh) and lh > 0 else math.nan
    if math.isfinite(ratio) and ratio >= IMBALANCE_RATIO:
        return "imbalance", (f"{rid} only on {replica_list(affected)}, which take {ratio:.1f}x the load of the healthy "
                             f"replicas ({replica_list(healthy)}): the router/load balancer sends them too much")
    if math.isfinite(la) and math.isfinite(lh) and lh == 0 and la > 0:
        return "imbalance", (f"{rid} only on {replica_list(affected)}; the healthy replicas ({replica_list(healthy)}) "
                             "take no load at all")
    return "sick-host", (f"{rid} only on {replica_list(affected)} at about the same load as the healthy replicas "
                         f"({replica_list(healthy)}): look at that host (GPU, neighbours, config drift)")


def fleet_findings(per: dict[str, Any], load: dict[str, float]) -> list[dict[str, Any]]:
    """Per rule that fired anywhere (``per``: replica -> its diagnosis, with ``incidents``): on
    which replicas, and whether it is one replica's problem or the fleet's."""
    names = sorted(per)
    fired: dict[str, dict[str, Any]] = defaultdict(dict)
    for name, diag in per.items():
        for inc in diag.incidents:
            for c in inc.causes:
                cur = fired[c.rule.id].get(name)
                if cur is None or c.confidence > cur[0].confidence:
                    fired[c.rule.id][name] = (c, inc)
    out = []
    for rid, hits in fired.items():
        affected = sorted(hits)
        healthy = [n for n in names if n not in hits]
        c0, _ = next(iter(hits.values()))
        if not healthy and len(names) > 1:
            scope, kind = "fleet", c0.rule.fleet_everywhere
            why = f"{rid} on all {len(names)} replicas ({c0.cause}): {EVERYWHERE[kind]}"
        elif len(names) == 1:
            scope, kind, why = "single", "single-instance", f"{rid} on the only instance"
        else:
            scope = "replica" if len(affected) <= len(healthy) else "partial"
            kind, why = _some(rid, affected, healthy, load)
        out.append({
            "rule": rid, "title": c0.rule.title, "severity": c0.rule.severity, "scope": scope, "kind": kind,
            "instances": affected, "healthy": healthy, "summary": why,
            "evidence": {n: {k: num(v) for k, v in hits[n][0].evidence.items()} for n in affected},
        })
    rank = {"critical": 0, "warning": 1, "info": 2}
    out.sort(key=lambda f: (rank.get(f["severity"], 3), f["rule"]))
    return out
