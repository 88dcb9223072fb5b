"""Live diagnosis: the offline rules, evaluated at each step on the window ending now, with
promtool-style hold (`for:`) before an incident opens, and a close when no rule of its symptom
has fired for one step."""
from __future__ import annotations

import dataclasses
import itertools

from ..capture import Capture
from ..signals import Prepared
from .coverage import context_limit
from .evaluate import Options, match_all, step_times
from .incident import Incident, incident_on
from .rules import Rule

_ids = itertools.count(1)


class LiveDiagnoser:
    """Feed it a capture of the recent past at each step; it says what opened and closed."""

    def __init__(self, rules: list[Rule], options: Options | None = None, keep_closed: int = 100):
        self.rules = rules
        self.options = options or Options()
        self.keep_closed = keep_closed
        self._since: dict[str, float] = {}
        self.incidents: list[Incident] = []
        #: the window of the last step (its signal values are memoised: reuse, don't recompute)
        self.last_window = None

    @property
    def open_incidents(self) -> list[Incident]:
        return [i for i in self.incidents if i.open]

    def step(self, cap: Capture, now_s: float) -> tuple[list[Incident], list[Incident]]:
        """Evaluate at ``now_s``; returns (opened, closed) incidents."""
        prep = Prepared(cap, self.options.slo)
        context_limit(prep, self.options.max_model_len_tokens)  # the limit diagnose would use, same source order
        return self.step_prepared(prep, now_s)

    def step_prepared(self, prep: Prepared, now_s: float) -> tuple[list[Incident], list[Incident]]:
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
        for k, inc in enumerate(self.incidents):
            if inc.open and inc.symptom not in symptoms:
                self.incidents[k] = dataclasses.replace(inc, closed_s=now_s)
                closed.append(self.incidents[k])
        for symptom in sorted(symptoms):
            fired = [(by_id[rid], *active[rid]) for rid in firing if by_id[rid].symptom == symptom]
            k = next((k for k, i in enumerate(self.incidents) if i.open and i.symptom == symptom), None)
            was = self.incidents[k] if k is not None else None
            # an incident opens held from the earliest hold of its rules; an open one takes the
            # latest step's causes, evidence and impact
            start = was.start_s if was is not None else min(self._since[rule.id] for rule, _, _ in fired)
            inc = incident_on(w, symptom, start, now_s, fired, self.options.slo)
            seen = was.rules_seen if was is not None else ()
            inc = dataclasses.replace(inc, id=was.id if was is not None else next(_ids),
                                      rules_seen=seen + tuple(c.rule.id for c in inc.causes if c.rule.id not in seen))
            if was is not None:
                self.incidents[k] = inc
            else:
                self.incidents.append(inc)
                opened.append(inc)
        done = [i for i in self.incidents if not i.open]
        if len(done) > self.keep_closed:
            drop = {id(i) for i in done[: len(done) - self.keep_closed]}
            self.incidents = [i for i in self.incidents if id(i) not in drop]
        return opened, closed


def replay(cap: Capture, rules: list[Rule], options: Options | None = None) -> list[Incident]:
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
