"""Live diagnosis: the offline rules, evaluated at each step on the window ending now, with
promtool-style hold (`for:`) before an incident opens, and a close when no rule of its symptom
has fired for one step."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ..capture import Capture
from ..signals import Prepared
from .coverage import context_limit
from .evaluate import Options, match_all, step_times
from .rules import SEVERITY_RANK, Rule

_ids = itertools.count(1)


@dataclass
class LiveCause:
    rule: Rule
    confidence: float
    cause: str
    evidence: dict[str, float]
    fixes: tuple  # Rule.fixes_for on the step's window


@dataclass
class LiveIncident:
    id: int
    symptom: str
    opened_s: float
    last_s: float
    causes: list[LiveCause]
    closed_s: float | None = None
    impact: dict[str, Any] = field(default_factory=dict)
    #: every rule that fired while it was open, first seen first (causes holds the latest step's)
    rules_seen: list[str] = field(default_factory=list)

    @property
    def open(self) -> bool:
        return self.closed_s is None

    @property
    def top(self) -> LiveCause:
        return self.causes[0]

    @property
    def severity(self) -> str:
        return max((c.rule.severity for c in self.causes), key=SEVERITY_RANK.__getitem__)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "symptom": self.symptom, "severity": self.severity, "title": self.top.rule.title,
            "open": self.open, "start_s": self.opened_s, "last_s": self.last_s, "end_s": self.closed_s,
            "impact": self.impact,
            "causes": [{"rule": c.rule.id, "status": c.rule.status, "cause": c.cause, "confidence": c.confidence,
                        "evidence": {k: (None if v != v else v) for k, v in c.evidence.items()},
                        "fixes": [{"title": f.title, "knobs": f.knobs} for f in c.fixes]} for c in self.causes],
        }


class LiveDiagnoser:
    """Feed it a capture of the recent past at each step; it says what opened and closed."""

    def __init__(self, rules: list[Rule], options: Options | None = None, keep_closed: int = 100):
        self.rules = rules
        self.options = options or Options()
        self.keep_closed = keep_closed
        self._since: dict[str, float] = {}
        self.incidents: list[LiveIncident] = []
        #: the window of the last step (its signal values are memoised: reuse, don't recompute)
        self.last_window = None

    @property
    def open_incidents(self) -> list[LiveIncident]:
        return [i for i in self.incidents if i.open]

    def step(self, cap: Capture, now_s: float) -> tuple[list[LiveIncident], list[LiveIncident]]:
        """Evaluate at ``now_s``; returns (opened, closed) incidents."""
        prep = Prepared(cap, self.options.slo)
        context_limit(prep, self.options.max_model_len_tokens)  # the limit diagnose would use, same source order
        return self.step_prepared(prep, now_s)

    def step_prepared(self, prep: Prepared, now_s: float) -> tuple[list[LiveIncident], list[LiveIncident]]:
        w = self.last_window = prep.window(now_s - self.options.lookback_s, now_s)
        active: dict[str, tuple[float, str]] = {}
        # active at its first step means it held over the step before (as offline counts a run)
        held_from = now_s - min(self.options.step_s, self.options.lookback_s)
        for rule, (ok, conf, title) in zip(self.rules, match_all(self.rules, w, self.options.slo)):
            if ok:
                active[rule.id] = (conf, title)
                self._since.setdefault(rule.id, held_from)
            else:
                self._since.pop(rule.id, None)
        by_id = {r.id: r for r in self.rules}
        firing = {rid for rid in active if now_s - self._since[rid] >= by_id[rid].for_s}
        opened, closed = [], []
        symptoms = {by_id[rid].symptom for rid in firing}
        for inc in self.open_incidents:
            if inc.symptom not in symptoms:
                inc.closed_s = now_s
                closed.append(inc)
        for symptom in sorted(symptoms):
            causes = [LiveCause(by_id[rid], active[rid][0], active[rid][1], {n: w.value(n) for n in by_id[rid].evidence},
                                by_id[rid].fixes_for(w.value, self.options.slo))
                      for rid in firing if by_id[rid].symptom == symptom]
            causes.sort(key=lambda c: (-c.confidence, -SEVERITY_RANK[c.rule.severity], c.rule.id))
            inc = next((i for i in self.open_incidents if i.symptom == symptom), None)
            impact = {"requests": w.n_requests}
            if causes[0].rule.impact:
                impact[causes[0].rule.impact] = w.value(causes[0].rule.impact)
            if inc is None:
                start = min(self._since[c.rule.id] for c in causes)
                inc = LiveIncident(next(_ids), symptom, start, now_s, causes, impact=impact)
                self.incidents.append(inc)
                opened.append(inc)
            else:
                inc.last_s, inc.causes, inc.impact = now_s, causes, impact
            inc.rules_seen += [c.rule.id for c in causes if c.rule.id not in inc.rules_seen]
        done = [i for i in self.incidents if not i.open]
        if len(done) > self.keep_closed:
            drop = {id(i) for i in done[: len(done) - self.keep_closed]}
            self.incidents = [i for i in self.incidents if id(i) not in drop]
        return opened, closed


def replay(cap: Capture, rules: list[Rule], options: Options | None = None) -> list[LiveIncident]:
    """Run the live path over a finished capture at the instants ``diagnose`` evaluates it at
    (the parity check between attach and diagnose; also what a recorded session would have
    announced). Every incident, open or closed, in opening order."""
    options = options or Options()
    prep = Prepared(cap, options.slo)
    context_limit(prep, options.max_model_len_tokens)
    times, step, lookback = step_times(prep.start_s, prep.end_s, options)
    if len(times) == 1:  # offline's single evaluation counts its hold over the whole window
        step = lookback
    live = LiveDiagnoser(rules, Options(lookback_s=lookback, step_s=step, slo=options.slo,
                                       max_model_len_tokens=options.max_model_len_tokens), keep_closed=10**9)
    for t in times:
        live.step_prepared(prep, float(t))
    return live.incidents
