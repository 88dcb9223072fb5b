"""Evaluate rules over rolling windows, hold them for their `for:` time, and group what
fires into incidents with ranked causes.

Offline and live use the same code: :func:`step_times` lays evaluation instants over the
capture; each instant looks back ``lookback_s``. A rule is *active* at an instant when its
symptom holds (enough requests, every condition known and true) and at least one of its
causes holds, and none of the rules it is ``suppressed_by`` is active at the same instant
(suppression acts only where they overlap in time). It *fires* once active for at least its
``for`` time, counted from the instant before the first active one. Firing intervals of rules
with the same symptom that overlap or touch become one incident; the evidence is then read
over the incident's own span, so the numbers describe the incident, not one window.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..objectives import Objective, load_slo_file
from ..objectives import resolve as resolve_objectives
from ..objectives import targets as objective_targets
from ..signals import Prepared, Window
from . import conditions as C
from .incident import Incident, incident_on
from .rules import SEVERITY_RANK, Rule

#: evaluations per capture at most: a day at ~15-minute resolution (each evaluation looks
#: back at least one step, so nothing between them is skipped; only boundaries get coarser)
MAX_STEPS = 100


@dataclass
class Options:
    lookback_s: float = 300.0
    step_s: float = 60.0
    #: stated objectives (--slo): signal -> target, e.g. {"ttft_p99_s": 2.0}
    slo: dict[str, float] = field(default_factory=dict)
    #: the server's context limit where the capture lacks it (--max-model-len)
    max_model_len_tokens: float | None = None
    #: the workload class whose default objectives apply (kvdoctor/objectives.py WORKLOADS);
    #: None: the SLO file's, else "chat"
    workload: str | None = None
    #: an SLO file (kvdoctor.yaml): objectives by default and per served model
    slo_file: str | None = None
    #: False: judge only stated objectives (--no-default-slo)
    default_objectives: bool = True
    #: the objectives judged, resolved once per capture by :meth:`resolve` (defaults, file, --slo)
    objectives: tuple[Objective, ...] | None = None

    def resolve(self, model: str | None = None) -> "Options":
        """These options with ``objectives`` filled for a capture of ``model`` (idempotent)."""
        if self.objectives is not None:
            return self
        file_targets, file_workload = load_slo_file(self.slo_file, model) if self.slo_file else ({}, None)
        objs = resolve_objectives(self.slo, self.workload or file_workload, file_targets,
                                  file_name=str(self.slo_file or ""), defaults=self.default_objectives)
        return dataclasses.replace(self, objectives=objs)

    @property
    def targets(self) -> dict[str, float]:
        """signal -> target of every objective judged (what ``slo.NAME`` in a rule reads)."""
        objs = self.objectives if self.objectives is not None else self.resolve().objectives
        return objective_targets(objs)


@dataclass(frozen=True)
class Activation:
    rule: Rule
    start_s: float
    end_s: float
    confidence: float
    cause: str


def step_times(start_s: float, end_s: float, opt: Options) -> tuple[np.ndarray, float, float]:
    """Evaluation instants, and the step and lookback actually used (widened for long spans
    so a capture never needs more than MAX_STEPS evaluations)."""
    span = max(end_s - start_s, 0.0)
    step = max(opt.step_s, span / MAX_STEPS)
    lookback = max(opt.lookback_s, step)
    if span <= lookback:
        return np.array([end_s]), step, span
    times = np.arange(start_s + lookback, end_s, step)
    if not len(times) or times[-1] < end_s:
        times = np.append(times, end_s)
    return times, step, lookback


def match(rule: Rule, w: Window, slo: dict[str, float]) -> tuple[bool, float, str]:
    """Whether the rule is active on a window, with the confidence and title of the best cause."""
    if w.n_requests < rule.min_requests:
        return False, 0.0, ""
    if not C.evaluate(rule.when, w.value, slo, rule.params):
        return False, 0.0, ""
    best = (0.0, "")
    for cause in rule.causes:
        if cause.when is None or C.evaluate(cause.when, w.value, slo, rule.params):
            if cause.confidence > best[0]:
                best = (cause.confidence, cause.title)
    return best[0] > 0, best[0], best[1]


def match_all(rules: list[Rule], w: Window, slo: dict[str, float]) -> list[tuple[bool, float, str]]:
    """:func:`match` for every rule on one window, then suppression: a rule is not active
    where a rule it is ``suppressed_by`` is active on the same window (live and offline share this)."""
    got = [match(rule, w, slo) for rule in rules]
    active = {rule.id for rule, (ok, _, _) in zip(rules, got) if ok}
    return [(False, 0.0, "") if ok and set(rule.suppressed_by) & active else (ok, conf, title)
            for rule, (ok, conf, title) in zip(rules, got)]


def activations(prep: Prepared, rules: list[Rule], opt: Options,
                progress: Callable[[int, int], None] | None = None) -> list[Activation]:
    times, step, lookback = step_times(prep.start_s, prep.end_s, opt)
    if not prep.arrivals_known:  # no clock: one window over the whole file, no time-based holds
        times, step, lookback = np.array([prep.end_s]), opt.step_s, prep.end_s - prep.start_s
    runs: dict[str, list[tuple[float, float, float, str]]] = {r.id: [] for r in rules}
    open_run: dict[str, list[Any]] = {}

    def evaluate_at(t: float) -> list[tuple[bool, float, str]]:
        w = prep.window(t - lookback, t)
        return match_all(rules, w, opt.slo)

    for k, t in enumerate(times):
        fresh_start = max(t - lookback, t - step) if len(times) > 1 else t - lookback
        _advance(rules, evaluate_at(t), t, fresh_start, runs, open_run)
        if progress:
            progress(k + 1, len(times))
    for rid, run in open_run.items():
        runs[rid].append(tuple(run))
    by_id = {r.id: r for r in rules}
    out = []
    for rid, spans in runs.items():
        rule = by_id[rid]
        for start, end, conf, title in spans:
            if end - start >= rule.for_s or not prep.arrivals_known:
                out.append(Activation(rule, start, end, conf, title))
    return out


def _advance(rules: list[Rule], matched: list[tuple[bool, float, str]], t: float, fresh_start: float,
             runs: dict[str, list[tuple[float, float, float, str]]], open_run: dict[str, list[Any]]) -> None:
    """Extend, open or close each rule's run of consecutive active evaluations."""
    for rule, (ok, conf, title) in zip(rules, matched):
        run = open_run.get(rule.id)
        if ok:
            if run is None:
                open_run[rule.id] = [fresh_start, t, conf, title]
            else:
                run[1] = t
                if conf > run[2]:
                    run[2], run[3] = conf, title
        elif run is not None:
            runs[rule.id].append(tuple(open_run.pop(rule.id)))


def incidents(prep: Prepared, rules: list[Rule], opt: Options | None = None,
              progress: Callable[[int, int], None] | None = None) -> list[Incident]:
    opt = opt or Options()
    acts = activations(prep, rules, opt, progress)
    out: list[Incident] = []
    for symptom in sorted({a.rule.symptom for a in acts}):
        group = sorted((a for a in acts if a.rule.symptom == symptom), key=lambda a: a.start_s)
        clusters: list[list[Activation]] = []
        for a in group:
            # overlap or touch; a gap of one step or more is a new incident (as live closes one)
            if clusters and a.start_s <= max(x.end_s for x in clusters[-1]):
                clusters[-1].append(a)
            else:
                clusters.append([a])
        for cluster in clusters:
            out.append(_incident(prep, symptom, cluster, opt))
    out.sort(key=lambda i: (-SEVERITY_RANK[i.severity], -max(c.confidence for c in i.causes), i.start_s))
    return out


def _incident(prep: Prepared, symptom: str, cluster: list[Activation], opt: Options) -> Incident:
    start, end = min(a.start_s for a in cluster), max(a.end_s for a in cluster)
    best: dict[str, Activation] = {}
    for a in cluster:
        if a.rule.id not in best or a.confidence > best[a.rule.id].confidence:
            best[a.rule.id] = a
    return incident_on(prep.window(start, end), symptom, start, end,
                       [(a.rule, a.confidence, a.cause) for a in best.values()], opt.slo)
