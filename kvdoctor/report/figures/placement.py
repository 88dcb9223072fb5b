"""Which charts go beside which incident: the charts each firing rule names (its ``charts:``
list), else those for its symptom; each drawn once, in the first incident it supports."""
from __future__ import annotations

from ...diagnosis import Diagnosis
from .chart import Chart

#: the charts for a symptom: for rules that name none, and after the causes' own
SYMPTOM_CHARTS: dict[str, tuple[str, ...]] = {
    "ttft": ("latency", "ttft-prompt"),
    "tpot": ("latency", "concurrency"),
    "latency": ("latency",),
    "memory": ("memory",),
    "errors": ("errors",),
    "turn-growth": ("turns",),
    "capacity": ("prompt-lengths", "concurrency"),
    "quality": ("prompt-lengths",),
}


def charts_for(incident, available: dict[str, Chart]) -> list[str]:
    """Chart ids that support an incident's findings, best first: the top cause's charts (its
    rule's ``charts:``, else its rule's symptom's), then the other causes', then the incident's
    symptom's."""
    out: list[str] = []
    for c in incident.causes:
        for key in c.rule.charts or SYMPTOM_CHARTS.get(c.rule.symptom, ()):
            if key in available and key not in out:
                out.append(key)
    for key in SYMPTOM_CHARTS.get(incident.symptom, ()):
        if key in available and key not in out:
            out.append(key)
    return out


def placement(diag: Diagnosis, charts: dict[str, Chart]) -> tuple[dict[int, list[str]], dict[int, list[str]], list[str]]:
    """Where each chart goes: ``(shown, referenced, rest)``. A chart is drawn once, in the
    first (most severe) incident it supports; later incidents it supports link to it; charts
    no incident needs go to the closing "more views" section."""
    shown: dict[int, list[str]] = {}
    referenced: dict[int, list[str]] = {}
    placed: set[str] = set()
    for n, inc in enumerate(diag.incidents, 1):
        for key in charts_for(inc, charts):
            if key in placed:
                referenced.setdefault(n, []).append(key)
            else:
                shown.setdefault(n, []).append(key)
                placed.add(key)
    rest = [k for k in charts if k not in placed]
    return shown, referenced, rest
