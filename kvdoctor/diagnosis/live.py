"""Live diagnosis: the offline rules, evaluated at each step on the window ending now, with
promtool-style hold (`for:`) before an incident opens, and a close when no rule of its symptom
has fired for one step."""
from __future__ import annotations

import dataclasses
import itertools

from ..capture import Capture
from ..signals import Prepared
from .coverage import context_limit
from .evaluate import ATTACHABLE, Match, Options, is_incident, match_all, standalone, step_times
from .incident import Incident, incident_on
from .onset import live_onset
from .rules import Rule

_ids = itertools.count(1)


class LiveDiagnoser:
    """Feed it a capture of the recent past at each step; it says what opened and closed."""

    def __init__(self, rules: list[Rule], options: Options | None = None, keep_closed: int = 100):
        self.rules = rules
        self.options = (options or Options()).resolve()
        self.keep_closed = keep_closed
        self._since: dict[str, float] = {}
        #: (rule id, harmful) of each rule's current hold: a change starts the hold again
        self._held: dict[str, tuple[str, bool] | None] = {}
        #: where the first step's hold counts from: the start of all this diagnoser has seen
        self._began: float | None = None
        self.incidents: list[Incident] = []
        #: the window of the last step (its signal values are memoised: reuse, don't recompute)
        self.last_window = None

    @property
    def open_incidents(self) -> list[Incident]:
        return [i for i in self.incidents if i.open]

    def step(self, cap: Capture, now_s: float) -> tuple[list[Incident], list[Incident]]:
        """Evaluate at ``now_s``; returns (opened, closed) incidents."""
        prep = Prepared(cap, self.options.targets, self.options.stated)
        context_limit(prep, self.options.max_model_len_tokens)  # the limit diagnose would use, same source order
        return self.step_prepared(prep, now_s)

    def step_prepared(self, prep: Prepared, now_s: float) -> tuple[list[Incident], list[Incident]]:
        w = self.last_window = prep.window(now_s - self.options.lookback_s, now_s)
        active: dict[str, Match] = {}
        # active at its first step means it held over the step before (as offline counts a run)
        held_from = now_s - min(self.options.step_s, self.options.lookback_s)
        for rule, m in zip(self.rules, match_all(self.rules, w, self.options.targets)):
            # a rule that turns harmful (or stops being) starts a new hold, as offline starts a new run
            key = (rule.id, is_incident(m.severity)) if m.ok else None
            if m.ok:
                active[rule.id] = m
                if self._held.get(rule.id) != key:
                    self._since[rule.id] = held_from
                    self._held[rule.id] = key
            else:
                self._since.pop(rule.id, None)
                self._held.pop(rule.id, None)
        by_id = {r.id: r for r in self.rules}
        firing = {rid for rid in active if now_s - self._since[rid] >= by_id[rid].for_s}
        if self._began is None:
            self._began = held_from
        if now_s - self._began <= self.options.lookback_s:
            # all it has seen fits in one window, shorter than a hold: as offline (evaluate.activations)
            # would judge the capture so far, a cause active now beside a broken objective of its
            # symptom is named (offline judges it once, so whatever is active on it spans it)
            broken = {by_id[r].symptom for r in firing if by_id[r].kind == "objective" and is_incident(active[r].severity)}
            firing |= {rid for rid, m in active.items() if by_id[rid].symptom in broken and is_incident(m.severity)}
        groups = self._groups(firing, by_id, active)
        opened, closed = [], []
        for k, inc in enumerate(self.incidents):
            if inc.open and (inc.symptom, inc.observation) not in groups:
                self.incidents[k] = dataclasses.replace(inc, closed_s=now_s)
                closed.append(self.incidents[k])
        for (symptom, observation), rids in sorted(groups.items()):
            fired = [(by_id[rid], active[rid].confidence, active[rid].cause, active[rid].severity) for rid in rids]
            k = next((k for k, i in enumerate(self.incidents)
                      if i.open and i.symptom == symptom and i.observation == observation), None)
            was = self.incidents[k] if k is not None else None
            # an incident opens from its onset (the change point in the window, as offline reads
            # it; else the earliest hold of its rules); an open one takes the latest step's causes
            if was is not None:
                start = was.start_s
            else:
                start = min(self._since[rid] for rid in rids)
                start = live_onset(prep, symptom, start, now_s, self.options.lookback_s)
            also = tuple(sorted({by_id[r].symptom for r in rids if by_id[r].kind == "objective"} - {symptom}))
            inc = incident_on(w, symptom, start, now_s, fired, self.options.targets,
                              objectives=self.options.objectives or (), also=also)
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

    @staticmethod
    def _groups(firing: set[str], by_id: dict[str, Rule], active: dict[str, Match]) -> dict[tuple[str, bool], list[str]]:
        """Firing rules by (symptom, observation): incidents (warning, critical) and observations
        (info) apart, one incident per cause as offline (evaluate._attach): a turn-growth or
        capacity finding joins a harm incident open beside it, and an incident that only says an
        objective broke joins one whose cause explains several symptoms (turn growth, KV memory)."""
        groups: dict[tuple[str, bool], list[str]] = {}
        for rid in sorted(firing):
            groups.setdefault((by_id[rid].symptom, not is_incident(active[rid].severity)), []).append(rid)
        harm_keys = [k for k in groups if not k[1] and k[0] not in ATTACHABLE
                     and not standalone([by_id[r] for r in groups[k]])]
        for key in [k for k in groups if not k[1] and k[0] in ATTACHABLE]:
            if harm_keys:
                groups[harm_keys[0]] += groups.pop(key)
        for key in [k for k in groups if not k[1]]:
            if key not in groups or not all(by_id[r].kind == "objective" for r in groups[key]):
                continue
            host = next((k for k in groups if k != key and not k[1] and any(
                by_id[r].kind != "objective" and by_id[r].symptom in (*ATTACHABLE, "memory") for r in groups[k])), None)
            if host is not None:
                rids = groups.pop(host) + groups.pop(key)
                merged = (key[0], False) if host[0] == "memory" else host
                groups[merged] = groups.get(merged, []) + rids
        return groups


def replay(cap: Capture, rules: list[Rule], options: Options | None = None) -> list[Incident]:
    """Run the live path over a finished capture at the instants ``diagnose`` evaluates it at
    (the parity check between attach and diagnose; also what a recorded session would have
    announced). Every incident, open or closed, in opening order."""
    options = (options or Options()).resolve(cap.meta.model)
    prep = Prepared(cap, options.targets, options.stated)
    context_limit(prep, options.max_model_len_tokens)
    times, step, lookback = step_times(prep.start_s, prep.end_s, options)
    if len(times) == 1:  # offline's single evaluation counts its hold over the whole window
        step = lookback
    live = LiveDiagnoser(rules, dataclasses.replace(options, lookback_s=lookback, step_s=step), keep_closed=10**9)
    for t in times:
        live.step_prepared(prep, float(t))
    return live.incidents
