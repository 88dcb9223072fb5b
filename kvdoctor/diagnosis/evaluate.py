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
import multiprocessing
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..objectives import DEFAULT_WORKLOAD, Objective, load_slo_file
from ..objectives import resolve as resolve_objectives
from ..objectives import targets as objective_targets
from ..signals import Prepared, Window
from . import conditions as C
from .incident import Incident, incident_on
from .onset import refine_window
from .rules import SEVERITY_RANK, Rule

#: evaluations per capture at most: a day at ~15-minute resolution (each evaluation looks
#: back at least one step, so nothing between them is skipped; only boundaries get coarser)
MAX_STEPS = 100

#: a capture with at least this many requests has its windows judged by forked workers (which
#: share the prepared columns copy-on-write); below it the fork and the results' trip back cost
#: more than the windows (benchmarks/bench_diagnose.py)
PARALLEL_MIN_REQUESTS = 200_000
#: forked workers at most (``Options.workers=0``: one a core up to this)
MAX_WORKERS = 4


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
    #: processes that judge the windows of a capture of PARALLEL_MIN_REQUESTS or more (forked, so
    #: POSIX only): 1 judges them here (the library's default: no fork inside a caller's process,
    #: the live sidecar's among them), 0 one a core (the CLI's)
    workers: int = 1

    def resolve(self, model: str | None = None) -> "Options":
        """These options with ``objectives`` filled for a capture of ``model`` (idempotent)."""
        if self.objectives is not None:
            return self
        file_targets, file_workload = load_slo_file(self.slo_file, model) if self.slo_file else ({}, None)
        workload = self.workload or file_workload or DEFAULT_WORKLOAD
        objs = resolve_objectives(self.slo, workload, file_targets, file_name=str(self.slo_file or ""),
                                  defaults=self.default_objectives)
        return dataclasses.replace(self, objectives=objs, workload=workload)

    @property
    def stated(self) -> frozenset[str]:
        """The signals of the objectives the user gave (--slo, an SLO file), not defaults."""
        objs = self.objectives if self.objectives is not None else self.resolve().objectives
        return frozenset(o.key for o in objs if o.stated)

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
    #: the finding's severity over the run: the rule's own where users are hurt, "info" where
    #: its harm does not hold (an observation), "critical" where its critical_when holds
    severity: str = "warning"
    #: the last evaluation before the run at which the rule was inactive (the onset lies after it)
    quiet_before_s: float = float("-inf")
    #: the run's first active evaluation (its window [first_eval_s - lookback, first_eval_s]
    #: holds the onset)
    first_eval_s: float = float("nan")


@dataclass(frozen=True)
class Match:
    """A rule on one window: active or not, its best cause and that finding's severity."""
    ok: bool
    confidence: float = 0.0
    cause: str = ""
    severity: str = "info"

    def __iter__(self):  # (ok, confidence, cause) as before, for callers that unpack three
        return iter((self.ok, self.confidence, self.cause))


INACTIVE = Match(False)


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


def match(rule: Rule, w: Window, slo: dict[str, float]) -> Match:
    """Whether the rule is active on a window, with the confidence and title of the best cause
    and the finding's severity there (info where its harm does not hold)."""
    if w.n_requests < rule.min_requests:
        return INACTIVE
    if not C.evaluate(rule.when, w.value, slo, rule.params):
        return INACTIVE
    best = (0.0, "")
    for cause in rule.causes:
        if cause.when is None or C.evaluate(cause.when, w.value, slo, rule.params):
            if cause.confidence > best[0]:
                best = (cause.confidence, cause.title)
    if best[0] <= 0:
        return INACTIVE
    return Match(True, best[0], best[1], rule.severity_on(w.value, slo))


def match_all(rules: list[Rule], w: Window, slo: dict[str, float]) -> list[Match]:
    """:func:`match` for every rule on one window, then suppression: a rule is not active
    where a rule it is ``suppressed_by`` is active on the same window (live and offline share this)."""
    got = [match(rule, w, slo) for rule in rules]
    active = {rule.id for rule, m in zip(rules, got) if m.ok}
    return [INACTIVE if m.ok and set(rule.suppressed_by) & active else m for rule, m in zip(rules, got)]


#: (prep, rules, slo) in a forked worker of :func:`_judge_windows` (inherited, never pickled)
_FORKED: tuple[Prepared, list[Rule], dict[str, float]] | None = None


def _judge_some(bounds: list[tuple[int, float, float]]) -> tuple[list[tuple[int, list[Match]]], set[str]]:
    """In a forked worker: match_all on the windows ``(k, t0, t1)``, and the signals they knew."""
    assert _FORKED is not None
    prep, rules, slo = _FORKED
    got = [(k, match_all(rules, prep.window(t0, t1), slo)) for k, t0, t1 in bounds]
    return got, set(prep.memo.get("known_signals", ()))


def _workers(prep: Prepared, n_windows: int, opt: Options) -> int:
    if opt.workers == 1 or n_windows < 4 or len(prep.t) < PARALLEL_MIN_REQUESTS:
        return 1
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    wanted = opt.workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return max(1, min(wanted, MAX_WORKERS, n_windows - 1))


def _judge_windows(prep: Prepared, rules: list[Rule], slo: dict[str, float], bounds: list[tuple[float, float]],
                   opt: Options, progress: Callable[[int, int], None] | None) -> list[list[Match]]:
    """match_all on every window ``(t0, t1)``, in order. On a large capture (``opt.workers``) the
    windows after the first are shared among forked workers, which inherit the prepared capture
    (the first is judged here first, so what signals memoise per capture is built once and
    inherited); each worker's judgements and the signals it knew come back, nothing else."""
    global _FORKED
    n = len(bounds)
    workers = _workers(prep, n, opt)
    out: list[list[Match] | None] = [None] * n
    done = 0
    for k in range(n if workers == 1 else 1):
        out[k] = match_all(rules, prep.window(*bounds[k]), slo)
        done += 1
        if progress:
            progress(done, n)
    if workers > 1:
        rest = [(k, *bounds[k]) for k in range(1, n)]
        # small interleaved parts: the workers finish together, and progress moves
        parts = [rest[i:i + 2] for i in range(0, len(rest), 2)]
        _FORKED = (prep, rules, slo)
        try:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                for got, known in pool.imap_unordered(_judge_some, parts):
                    for k, ms in got:
                        out[k] = ms
                    prep.memo.setdefault("known_signals", set()).update(known)
                    done += len(got)
                    if progress:
                        progress(done, n)
        finally:
            _FORKED = None
    return out  # type: ignore[return-value]


def is_incident(severity: str) -> bool:
    """Warning and critical findings are incidents; info ones are observations."""
    return SEVERITY_RANK[severity] >= SEVERITY_RANK["warning"]


def activations(prep: Prepared, rules: list[Rule], opt: Options,
                progress: Callable[[int, int], None] | None = None) -> list[Activation]:
    """Each rule's runs of consecutive active evaluations that held for its ``for:``. A run is
    either harmful (warning/critical) or an observation (info): a rule that turns harmful starts
    a new run there, so an incident starts where users began to be hurt, not where the shape did."""
    times, step, lookback = step_times(prep.start_s, prep.end_s, opt)
    if not prep.arrivals_known:  # no clock: one window over the whole file, no time-based holds
        times, step, lookback = np.array([prep.end_s]), opt.step_s, prep.end_s - prep.start_s
    slo = opt.targets
    runs: list[tuple[Rule, list[Any]]] = []
    open_run: dict[tuple[str, bool], list[Any]] = {}
    last_quiet: dict[tuple[str, bool], float] = {}
    by_id = {r.id: r for r in rules}

    matches = _judge_windows(prep, rules, slo, [(float(t - lookback), float(t)) for t in times], opt, progress)
    for k, t in enumerate(times):
        fresh_start = max(t - lookback, t - step) if len(times) > 1 else t - lookback
        for rule, m in zip(rules, matches[k]):
            for harmful in (False, True):
                key = (rule.id, harmful)
                run = open_run.get(key)
                if m.ok and is_incident(m.severity) == harmful:
                    if run is None:
                        open_run[key] = [fresh_start, t, m.confidence, m.cause, m.severity,
                                         last_quiet.get(key, float("-inf")), float(t)]
                    else:
                        run[1] = t
                        if m.confidence > run[2]:
                            run[2], run[3] = m.confidence, m.cause
                        if SEVERITY_RANK[m.severity] > SEVERITY_RANK[run[4]]:
                            run[4] = m.severity
                else:
                    if run is not None:
                        runs.append((rule, open_run.pop(key)))
                    last_quiet[key] = t
    for (rid, _), run in open_run.items():
        runs.append((by_id[rid], run))
    # a capture shorter than a hold (one window, so every run spans all of it): a cause active over
    # the whole capture beside a broken objective of its symptom is named. The hold keeps a
    # transient from paging; here the objective pages anyway (its hold is 0 s), and a cause that
    # held through all of the harm seen is as sustained as that harm (a 28 s burst on two slots
    # would otherwise page with no cause). Observations and symptoms no objective broke keep it.
    broken = {rule.symptom for rule, run in runs if rule.kind == "objective" and is_incident(run[4])} \
        if len(times) == 1 else set()
    out = []
    for rule, (start, end, conf, title, severity, quiet, first) in runs:
        if (end - start >= rule.for_s or not prep.arrivals_known
                or (rule.symptom in broken and is_incident(severity))):
            out.append(Activation(rule, start, end, conf, title, severity, quiet, first))
    return out


#: symptoms that explain another's harm rather than being one: a turn-growth or capacity finding
#: overlapping a TTFT, TPOT or latency incident is one of its causes, not an incident of its own
ATTACHABLE = ("turn-growth", "capacity", "quality")
HARM_SYMPTOMS = ("ttft", "tpot", "latency", "errors", "memory")


def incidents(prep: Prepared, rules: list[Rule], opt: Options | None = None,
              progress: Callable[[int, int], None] | None = None) -> list[Incident]:
    """Incidents (warning, critical) and observations (info), most severe first. Harmful runs of
    one symptom that overlap or touch form one incident; so do observation runs. An incident's
    window starts where its evidence changed (onset.py), not where the first window began."""
    opt = opt or Options()
    acts = activations(prep, rules, opt, progress)
    out: list[Incident] = []
    for harmful in (True, False):
        group_acts = [a for a in acts if is_incident(a.severity) == harmful]
        clusters = _clusters(group_acts)
        if harmful:
            clusters = _attach(clusters)
        for symptom, cluster in clusters:
            first = min(cluster, key=lambda a: a.start_s)
            start, end = refine_window(prep, symptom, first.start_s, max(a.end_s for a in cluster), first.first_eval_s,
                                       first.quiet_before_s, opt.lookback_s, opt.step_s)
            out.append(_incident(prep, symptom, cluster, start, end, opt))
    out.sort(key=lambda i: i.lead_key)
    return out


def _clusters(acts: list[Activation]) -> list[tuple[str, list[Activation]]]:
    out: list[tuple[str, list[Activation]]] = []
    for symptom in sorted({a.rule.symptom for a in acts}):
        group = sorted((a for a in acts if a.rule.symptom == symptom), key=lambda a: a.start_s)
        clusters: list[list[Activation]] = []
        for a in group:
            # overlap or touch; a gap of one step or more is a new incident (as live closes one)
            if clusters and a.start_s <= max(x.end_s for x in clusters[-1]):
                clusters[-1].append(a)
            else:
                clusters.append([a])
        out += [(symptom, c) for c in clusters]
    return out


def _span(cluster: list[Activation]) -> tuple[float, float]:
    return min(a.start_s for a in cluster), max(a.end_s for a in cluster)


def _overlap(a: list[Activation], b: list[Activation]) -> float:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return min(a1, b1) - max(a0, b0)


def standalone(rules: list[Rule]) -> bool:
    """A harm that stands alone (its rules' ``standalone``: answers cut at the context limit):
    nothing attaches to it, though the bare objective it breaks (error rate) fires beside it."""
    return any(r.standalone for r in rules) and all(r.standalone or r.kind == "objective" for r in rules)


def _attach(clusters: list[tuple[str, list[Activation]]]) -> list[tuple[str, list[Activation]]]:
    """One incident per cause, not one per rule or per symptom:

    * each ATTACHABLE cluster (turn growth, capacity, quality) moves into the harm incident it
      overlaps most ("every turn is slower" is why TTFT broke its objective, not a second page);
    * a harm incident that only says an objective broke (no rule named why) joins an overlapping
      incident whose cause explains more than one symptom: turn growth (both TTFT and decode grow
      with the history) or KV memory (preemption recomputes and requeues: TTFT and TPOT alike).
      The merged incident keeps the harm's symptom and reads the breaches of both.
    """
    keep = [(s, c) for s, c in clusters if s not in ATTACHABLE]
    for symptom, cluster in clusters:
        if symptom not in ATTACHABLE:
            continue
        best, best_overlap = None, 0.0
        for k, (hs, hc) in enumerate(keep):
            if standalone([a.rule for a in hc]):
                continue
            overlap = _overlap(cluster, hc)
            (a0, a1), (h0, h1) = _span(cluster), _span(hc)
            if overlap > best_overlap or (overlap == best_overlap == 0 and a0 <= h1 and h0 <= a1):
                best, best_overlap = k, overlap
        if best is None:
            keep.append((symptom, cluster))
        else:
            hs, hc = keep[best]
            keep[best] = (hs, hc + cluster)
    explains_several = lambda c: any(a.rule.kind != "objective" and a.rule.symptom in (*ATTACHABLE, "memory")  # noqa: E731
                                     for a in c)
    out: list[tuple[str, list[Activation]]] = []
    merged: set[int] = set()
    for k, (symptom, cluster) in enumerate(keep):
        if k in merged or not all(a.rule.kind == "objective" for a in cluster):
            continue
        host = next((j for j, (hs, hc) in enumerate(keep)
                     if j != k and j not in merged and explains_several(hc) and _overlap(cluster, hc) > 0), None)
        if host is not None:
            hs, hc = keep[host]
            # the harm names the incident; the memory finding is its cause
            keep[host] = (symptom if hs == "memory" else hs, hc + cluster)
            merged.add(k)
    out = [kc for k, kc in enumerate(keep) if k not in merged]
    return out


def _incident(prep: Prepared, symptom: str, cluster: list[Activation], start: float, end: float,
              opt: Options) -> Incident:
    best: dict[str, Activation] = {}
    for a in cluster:
        if a.rule.id not in best or a.confidence > best[a.rule.id].confidence:
            best[a.rule.id] = a
    severity = {rid: max((a.severity for a in cluster if a.rule.id == rid), key=SEVERITY_RANK.__getitem__)
                for rid in best}
    # every symptom whose objective the cluster's rules judge: a merged incident reads all its breaches
    also = tuple(sorted({a.rule.symptom for a in cluster if a.rule.kind == "objective"} - {symptom}))
    return incident_on(prep.window(start, end), symptom, start, end,
                       [(a.rule, a.confidence, a.cause, severity[a.rule.id]) for a in best.values()],
                       opt.targets, objectives=opt.objectives or (), also=also)
