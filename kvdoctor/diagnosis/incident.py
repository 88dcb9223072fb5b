"""One incident type and one JSON shape, for `diagnose` and for the live sidecar.

An incident is a symptom with its ranked causes, the evidence each cause read and the fixes
that apply, over ``start_s``..``end_s`` (the last evaluation at which a rule of it fired).
Offline, evidence and impact are read over the incident's own span; live, over the window of
the latest step. Live incidents also carry a number, the time they closed and every rule seen
while open. The JSON is ``diagnose --format json``'s incident (docs/diagnose-json.md); live
output adds ``id``, ``open``, ``closed`` and ``closed_s``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..engines.labels import ENGINE_KNOB
from ..numeric import json_number
from ..objectives import Objective
from ..signals import REGISTRY, Window
from ..timeparse import iso_utc
from ..signals.harm import Reading, readings
from .rules import SEVERITY_RANK, Rule


@dataclass(frozen=True)
class CauseFinding:
    rule: Rule
    confidence: float
    cause: str
    evidence: dict[str, float]
    #: the rule's fixes that apply to this incident, in order (Rule.fixes_for)
    fixes: tuple
    #: this finding's severity: the rule's own where users are hurt, info where they are not
    severity: str = ""
    #: fixes already in effect on the recorded server (Rule.fixes_in_effect): said, never advised
    in_effect: tuple = ()
    #: what to measure first when the cause is a hypothesis the data cannot confirm ('' if none)
    measure: str = ""

    @property
    def effective_severity(self) -> str:
        return self.severity or self.rule.severity


@dataclass(frozen=True)
class Breach:
    """An objective broken over the incident's window (signals/harm.py Reading): measured against
    target, and how many requests (inter-token gaps, for ITL) were over it."""
    objective: Objective
    reading: Reading

    @property
    def measured(self) -> float:
        return self.reading.measured

    def to_json(self) -> dict[str, Any]:
        r = self.reading
        return {**self.objective.to_json(), "measured": json_number(r.measured), "over": r.over, "total": r.total,
                "share_over": json_number(r.share_over), "burn_rate": json_number(r.burn_rate),
                "p_value": json_number(r.p_value)}


def lead_key(severity: str, confidence: float, start_s: float, burn_rate: float | None = None) -> tuple[int, float, float, float]:
    """The order incidents are read in, lead first: the most severe, then the one whose best
    finding is surest, then the earliest, then the one whose broken objective burns its error
    budget fastest (``burn_rate``: the share of requests over the objective against the share it
    allows; what an SLO's burn-rate alert pages on first). The one order for every output (the
    summary's first line leads with the first) and for the fault benchmark, which scores the lead
    users read."""
    burn = burn_rate if burn_rate is not None and burn_rate == burn_rate else 0.0
    return -SEVERITY_RANK[severity], -confidence, start_s, -burn


@dataclass(frozen=True)
class Incident:
    symptom: str
    start_s: float
    end_s: float
    causes: list[CauseFinding]  # ranked, best first
    impact: dict[str, Any]
    #: objectives of this symptom broken over the incident's window, worst first
    breaches: tuple[Breach, ...] = ()
    #: live only: its number in this run, when it closed (None: still open) and every rule
    #: that fired while it was open, first seen first (causes holds the latest step's)
    id: int | None = None
    closed_s: float | None = None
    rules_seen: tuple[str, ...] = field(default=())

    @property
    def top(self) -> CauseFinding:
        return self.causes[0]

    @property
    def severity(self) -> str:
        return max((c.effective_severity for c in self.causes), key=SEVERITY_RANK.__getitem__)

    @property
    def observation(self) -> bool:
        """An info-level finding: no objective broken and no user paying for it."""
        return self.severity == "info"

    @property
    def open(self) -> bool:
        return self.closed_s is None

    @property
    def lead_key(self) -> tuple[int, float, float, float]:
        return lead_key(self.severity, max(c.confidence for c in self.causes), self.start_s, self.burn_rate)

    @property
    def burn_rate(self) -> float | None:
        """The fastest burn among its broken objectives (None without a breach)."""
        return max((b.reading.burn_rate for b in self.breaches if b.reading.burn_rate == b.reading.burn_rate), default=None)

    def to_json(self, label: Callable[[float], str] | None = None, arrivals_known: bool = True) -> dict[str, Any]:
        """The JSON shape; ``label`` writes a time as people read it (default: a unix time in
        UTC, as the sidecar's clock is)."""
        label = label or (lambda t: time_label(t, 0.0, "unix"))
        out: dict[str, Any] = {"id": self.id} if self.id is not None else {}
        out |= {
            "symptom": self.symptom,
            "severity": self.severity,
            "title": self.top.rule.title,
            "start": label(self.start_s),
            "end": label(self.end_s),
            "start_s": json_number(self.start_s) if arrivals_known else None,
            "end_s": json_number(self.end_s) if arrivals_known else None,
            "impact": {k: json_number(v) for k, v in self.impact.items()},
            "breaches": [b.to_json() for b in self.breaches],
            "causes": [_cause_json(c) for c in self.causes],
        }
        if self.id is not None:
            out |= {"open": self.open, "closed": None if self.open else label(self.closed_s),
                    "closed_s": json_number(self.closed_s)}
        return out


def _cause_json(c: CauseFinding) -> dict[str, Any]:
    return {
        "rule": c.rule.id,
        "title": c.rule.title,
        "status": c.rule.status,  # experimental: proven only on simulated data
        "severity": c.effective_severity,
        "cause": c.cause,
        "confidence": round(c.confidence, 3),
        "measure_first": c.measure or None,
        "evidence": {name: {"value": json_number(v), "unit": REGISTRY[name].unit} for name, v in c.evidence.items()},
        "not_measured": [name for name, v in c.evidence.items() if json_number(v) is None],
        "fixes": [{"title": f.title, "why": f.why, "knobs": f.knobs} for f in c.fixes],
        "in_effect": [{"title": f.title, "instead": f.if_in_effect, "knobs": f.knobs} for f in c.in_effect],
        "references": list(c.rule.references),
    }


def time_label(t: float, start_s: float, clock: str, arrivals_known: bool = True) -> str:
    """A time as people read it: ISO 8601 on a unix clock, ``+Ns`` from the start otherwise,
    ``#N`` (the request's place in the file) when there are no arrival times."""
    if not arrivals_known:
        return f"#{t - start_s + 1:.0f}"
    if clock == "unix" and t > 1e9:
        return iso_utc(t)
    return f"+{t - start_s:.0f}s"


def incident_on(w: Window, symptom: str, start_s: float, end_s: float,
                fired: Iterable[tuple], slo: dict[str, float],
                objectives: Iterable[Objective] = (), also: tuple[str, ...] = ()) -> Incident:
    """The incident of rules that fired ((rule, confidence, cause title[, severity])), its causes
    ranked and their evidence, fixes and the impact read on ``w``; ``objectives`` broken on ``w``
    whose symptom is the incident's become its breaches."""
    causes = []
    engine = ENGINE_KNOB.get((w.prep.meta.engine or "").lower())
    for rule, conf, title, *sev in fired:
        in_effect = rule.fixes_in_effect(w.value, slo, engine)
        measure = next((c.measure for c in rule.causes if c.title == title), "")
        causes.append(CauseFinding(rule, conf, title, {name: w.value(name) for name in rule.evidence},
                                   rule.fixes_for(w.value, slo, engine), sev[0] if sev else rule.severity, in_effect, measure))
    # incidents first by how bad, then how sure: a harmful cause outranks an observation of the same symptom
    causes.sort(key=lambda c: (-(SEVERITY_RANK[c.effective_severity] >= 2), -c.confidence,
                               -SEVERITY_RANK[c.effective_severity], c.rule.id))
    objectives = tuple(objectives)
    breaches = sorted((b for s in (symptom, *also) for b in breaches_on(w, s, objectives)),
                      key=lambda b: -b.reading.burn_rate)
    return Incident(symptom, start_s, end_s, causes, _impact(w, causes[0].rule, slo), breaches=tuple(breaches))


def breaches_on(w: Window, symptom: str, objectives: Iterable[Objective]) -> tuple[Breach, ...]:
    """The objectives of ``symptom`` broken on ``w`` (TTFT and queue time for ``ttft``, TPOT and
    ITL for ``tpot``, end-to-end for ``latency``, the error rate for ``errors``), worst first."""
    by_signal = {r.signal: r for r in readings(w)}
    out = [Breach(o, by_signal[o.key]) for o in objectives
           if o.symptom == symptom and o.key in by_signal and by_signal[o.key].broken]
    out.sort(key=lambda b: -b.reading.burn_rate)
    return tuple(out)


def _impact(w: Window, top: Rule, slo: dict[str, float]) -> dict[str, Any]:
    errors = w.value("errors")  # NaN: no request records and no engine failure counter
    impact: dict[str, Any] = {"requests": w.n_requests, "errors": int(errors) if errors == errors else None}
    if top.impact:
        impact["signal"] = top.impact
        impact["value"] = w.value(top.impact)
        if top.impact in slo:
            impact["slo"] = slo[top.impact]
    return impact
