"""Prometheus alerting rules from kvdoctor's rules (rules/*.yaml) and engine tables.

A rule's condition becomes PromQL the way fleet mode evaluates it on engine metrics alone: a
leaf whose signal has no PromQL form (request records, fits) or no metric on that engine is
*unknown*, which is false, exactly as a NaN signal is in kvdoctor (conditions.py): ``any``
keeps its other branches, ``all`` fails. A rule whose whole condition is unknown on an engine is
left out for it, with the reason. The alert's value (``$value``) is the first signal of the branch that held (PromQL's comparison keeps its left side), named in the summary.

Beside the rules come the alerts on-call asks for that no single rule is: TTFT/TPOT P99 over the
SLO, KV cache full with requests waiting, server down, and the sidecar's own incidents.
``kvdoctor rules export --format prometheus -o alerts/`` writes them, one file per engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import yaml

from ..diagnosis import conditions as C
from ..engines import TABLES
from ..engines.neutral import EngineTable
from ..objectives import DEFAULT_WORKLOAD, WORKLOADS
from ..signals import REGISTRY
from . import promql

ENGINES = tuple(t for t in TABLES if t.name != "dcgm")
#: where runbook_url points (docs/runbooks.md, generated beside the alerts); --runbook-base changes it
RUNBOOK_BASE = "https://github.com/kvdoctor/kvdoctor/blob/main/docs/runbooks.md"
#: SLOs the shipped files use (an operator re-runs the export with their own --slo)
DEFAULT_SLO = dict(WORKLOADS[DEFAULT_WORKLOAD])  # the default objectives (docs/slo.md)
#: a page needs trouble that lasts: every alert holds at least this long (a rule's own for: when longer)
MIN_FOR_S = 120.0
SIDECAR_FILE = "kvdoctor-sidecar"


@dataclass(frozen=True)
class Extra:
    """An alert that is one signal question rather than a whole rule, in the rule condition language."""
    name: str
    when: Any
    severity: str
    runbook: str
    title: str


EXTRAS = (
    Extra("KvdoctorTTFTP99OverSLO", "ttft_p99_s > slo.ttft_p99_s", "warning", "tail-latency",
          "TTFT P99 over the SLO"),
    Extra("KvdoctorTPOTP99OverSLO", "tpot_p99_s > slo.tpot_p99_s", "warning", "tail-latency",
          "TPOT P99 over the SLO"),
    # a full cache with a queue: admission is bounded by KV memory, not by slots
    Extra("KvdoctorKVCacheFullWithWaiting", {"all": ["kv_usage_p50_frac >= 0.9", "requests_waiting_p50 >= 1"]},
          "critical", "kv-pressure-preemption", "KV cache full while requests wait"),
)


@dataclass
class Options:
    window: str = "5m"
    slo: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SLO))
    min_for_s: float = MIN_FOR_S
    #: every alert's for: (tests use a short one); None: max(rule's for:, min_for_s)
    for_s: float | None = None
    runbook_base: str = RUNBOOK_BASE


@dataclass
class Skipped:
    rule: str
    engine: str | None  # None: on every engine
    why: str


@dataclass
class Export:
    #: file stem -> Prometheus rule groups document
    files: dict[str, dict[str, Any]]
    skipped: list[Skipped]
    options: Options


def camel(rule_id: str) -> str:
    return "Kvdoctor" + "".join(p[:1].upper() + p[1:] for p in rule_id.split("-"))


def duration(s: float) -> str:
    """Seconds as a Prometheus duration (``2m``, ``30s``, ``1h30m``)."""
    s = int(round(s))
    if s == 0:
        return "0s"
    out = ""
    for unit, n in (("h", 3600), ("m", 60), ("s", 1)):
        if s >= n:
            out += f"{s // n}{unit}"
            s %= n
    return out


def _num(x: float) -> str:
    return f"{x:g}" if math.isfinite(x) else str(x)


def translate(cond: C.Cond, table: EngineTable, window: str, slo: dict[str, float], params: dict[str, float],
              unknown: set[str]) -> str | None:
    """PromQL for a condition on one engine; None when it is unknown there (``unknown`` collects
    the signals that made leaves unknown)."""
    if isinstance(cond, C.Node):
        if cond.kind == "not":
            unknown.add("not: …")
            return None
        parts = [translate(c, table, window, slo, params, unknown) for c in cond.children]
        if cond.kind == "all":
            return None if None in parts else " and ".join(f"({p})" for p in parts) if len(parts) > 1 else parts[0]
        known = [p for p in parts if p is not None]
        return None if not known else " or ".join(f"({p})" for p in known) if len(known) > 1 else known[0]
    lhs = promql.signal(cond.lhs, table, window)
    if lhs is None:
        unknown.add(cond.lhs)
        return None
    if cond.rhs.startswith("slo."):
        if cond.rhs[4:] not in slo:
            unknown.add(cond.rhs)
            return None
        rhs = _num(cond.factor * slo[cond.rhs[4:]])
    elif cond.rhs.startswith("param."):
        rhs = _num(cond.factor * params[cond.rhs[6:]])
    elif C._is_signal(cond.rhs):
        other = promql.signal(cond.rhs, table, window)
        if other is None:
            unknown.add(cond.rhs)
            return None
        rhs = f"{_num(cond.factor)} * ({other})" if cond.factor != 1 else f"({other})"
    else:
        rhs = _num(cond.factor * float(cond.rhs))
    return f"({lhs}) {cond.op} {rhs}"


def _branches(cond: C.Cond, table: EngineTable, window: str, slo, params) -> list[str]:
    """The signal whose value ``$value`` carries, per top-level ``any`` branch that is expressible:
    a comparison keeps its left side, ``and`` its left operand, so it is the branch's first leaf."""
    kids = cond.children if isinstance(cond, C.Node) and cond.kind == "any" else (cond,)
    return [C.leaves(k)[0].lhs for k in kids if translate(k, table, window, slo, params, set()) is not None]


_HUMANIZE = {"s": "humanizeDuration", "fraction": "humanizePercentage"}


def _value(signal: str) -> str:
    return "{{ $value | " + _HUMANIZE.get(REGISTRY[signal].unit, "humanize") + " }}"


def _alert(name: str, cond: C.Cond, table: EngineTable, opts: Options, params: dict[str, float],
           severity: str, title: str, rule_id: str, for_s: float) -> tuple[dict | None, set[str]]:
    unknown: set[str] = set()
    expr = translate(cond, table, opts.window, opts.slo, params, unknown)
    if expr is None:
        return None, unknown
    heads = list(dict.fromkeys(_branches(cond, table, opts.window, opts.slo, params)))
    value = (f"{heads[0]} = {_value(heads[0])}" if len(heads) == 1 else
             f"value {{{{ $value | humanize }}}} (the first signal of the branch that held: {' or '.join(heads)})")
    hold = opts.for_s if opts.for_s is not None else max(for_s, opts.min_for_s)
    return {
        "alert": name,
        "expr": expr,
        "for": duration(hold),
        "labels": {"severity": severity, "engine": table.name, "kvdoctor_rule": rule_id},
        "annotations": {
            "summary": f"{{{{ $labels.instance }}}} ({table.title}): {title}; {value} over {opts.window}",
            # the rule's description and fixes are on the runbook page; this says how to dig in
            "description": "Diagnose: kvdoctor diagnose --prometheus URL --selector '{instance=\"{{ $labels.instance }}\"}' --since 1h",
            "runbook_url": f"{opts.runbook_base}#{rule_id}",
        },
    }, unknown


def _known_signals() -> set[str]:
    return set(REGISTRY)


def _server_down(table: EngineTable, opts: Options) -> dict:
    """``up == 0`` on targets that exported this engine's metrics in the last hour (no job name needed)."""
    seen = " or ".join(f"count by ({promql.BY}) (count_over_time({s}[1h]))"
                       for s in promql.selectors(table, "requests_running"))
    return {
        "alert": "KvdoctorServerDown",
        "expr": f"(up == 0) and on (job, instance) ({seen})",
        "for": duration(opts.for_s if opts.for_s is not None else 60),
        "labels": {"severity": "critical", "engine": table.name, "kvdoctor_rule": "server-down"},
        "annotations": {
            "summary": f"{{{{ $labels.instance }}}} ({table.title}): scrape failing, the server is down or unreachable",
            "description": "Prometheus cannot scrape an instance that exported engine metrics in the last hour.",
            "runbook_url": f"{opts.runbook_base}#server-down",
        },
    }


def _sidecar(opts: Options) -> dict:
    expr = ("(max by (job, instance, rule, symptom, severity) (kvdoctor_incident_active) > 0) "
            "* on (job, instance) group_left (server, engine) max by (job, instance, server, engine) (kvdoctor_info)")
    return {"groups": [{"name": "kvdoctor-sidecar", "rules": [{
        "alert": "KvdoctorIncidentActive",
        "expr": expr,
        # the sidecar already held the rule's for: before opening; this rides over one lost scrape
        "for": duration(opts.for_s if opts.for_s is not None else 60),
        "labels": {"kvdoctor_rule": "{{ $labels.rule }}"},
        "annotations": {
            "summary": "{{ $labels.server }}: kvdoctor sidecar on {{ $labels.instance }} has an open "
                       "{{ $labels.symptom }} incident, top cause {{ $labels.rule }}",
            "description": "The sidecar's live rules opened an incident; its /incidents endpoint has the evidence and fixes.",
            "runbook_url": f"{opts.runbook_base}#{{{{ $labels.rule }}}}",
        }}]}]}


def export(rules: list, opts: Options | None = None) -> Export:
    opts = opts or Options()
    files: dict[str, dict[str, Any]] = {}
    skipped: list[Skipped] = []
    per_rule_unknown: dict[str, dict[str, set[str]]] = {}
    for table in ENGINES:
        alerts: list[dict] = []
        for rule in sorted(rules, key=lambda r: r.id):
            a, unknown = _alert(camel(rule.id), rule.when, table, opts, rule.params, rule.severity,
                                rule.title, rule.id, rule.for_s)
            if a is None:
                per_rule_unknown.setdefault(rule.id, {})[table.name] = unknown
            else:
                alerts.append(a)
        for x in EXTRAS:
            cond = C.parse(x.when, x.name, _known_signals(), {})
            a, unknown = _alert(x.name, cond, table, opts, {}, x.severity, x.title, x.runbook, 0.0)
            if a is None:
                per_rule_unknown.setdefault(x.name, {})[table.name] = unknown
            else:
                alerts.append(a)
        if promql.selectors(table, "requests_running"):
            alerts.append(_server_down(table, opts))
        files[table.name] = {"groups": [{"name": f"kvdoctor-{table.name}", "rules": alerts}]}
    files[SIDECAR_FILE] = _sidecar(opts)
    conds = {r.id: r.when for r in rules} | {x.name: C.parse(x.when, x.name, _known_signals(), {}) for x in EXTRAS}
    for rid, per_engine in sorted(per_rule_unknown.items()):
        cond = conds[rid]
        if not _expressible(cond, lambda s: s in promql.SIGNALS):
            no_form = sorted({leaf.lhs for leaf in C.leaves(cond)} - set(promql.SIGNALS))
            skipped.append(Skipped(rid, None, _why_no_form(no_form)))
        else:
            for eng, unknown in per_engine.items():
                skipped.append(Skipped(rid, eng, f"no {eng} metric for {', '.join(sorted(u for u in unknown if u in promql.SIGNALS))}"))
    return Export(files, skipped, opts)


def _expressible(cond: C.Cond, known) -> bool:
    """Whether a condition can hold when exactly the signals ``known`` accepts have values."""
    if isinstance(cond, C.Node):
        if cond.kind == "not":
            return False
        results = [_expressible(c, known) for c in cond.children]
        return all(results) if cond.kind == "all" else any(results)
    return known(cond.lhs) and (not C._is_signal(cond.rhs) or known(cond.rhs))


def _why_no_form(signals: list[str]) -> str:
    """Signals grouped by why they have no PromQL form."""
    by_why: dict[str, list[str]] = {}
    for s in signals:
        by_why.setdefault(promql.why_not(s), []).append(s)
    return "; ".join(f"{', '.join(v)}: {k}" for k, v in by_why.items())


class _Dumper(yaml.SafeDumper):
    pass


def render(doc: dict[str, Any], header: str) -> str:
    body = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=10**6, allow_unicode=True)
    return header + body


def header(name: str, ex: Export) -> str:
    o = ex.options
    slo = " ".join(f"--slo {k.removesuffix('_s')}={_num(v)}{'s' if k.endswith('_s') else ''}" for k, v in sorted(o.slo.items()))
    lines = ["# Generated by `kvdoctor rules export --format prometheus` from rules/*.yaml and the engine tables",
             f"# (kvdoctor/engines/); do not edit by hand: re-run it. Window {o.window}, {slo}.",
             "# Load with rule_files: in prometheus.yml; docs/oncall.md routes them through Alertmanager to kvdoctor oncall."]
    if name != SIDECAR_FILE:
        nowhere = [s.rule for s in ex.skipped if s.engine is None]
        here = [s for s in ex.skipped if s.engine == name]
        if nowhere:
            lines.append("# Not expressible in PromQL (need request records, correlations or fits; `kvdoctor rules export`")
            lines.append(f"# says why): {', '.join(nowhere)}")
        lines += [f"# Not on this engine: {s.rule}: {s.why}" for s in here]
    return "\n".join(lines) + "\n"


def files_text(ex: Export) -> dict[str, str]:
    """File name -> text, as written to the alerts folder."""
    return {f"{name}.yaml": render(doc, header(name, ex)) for name, doc in ex.files.items()}


def skipped_text(ex: Export) -> str:
    lines = []
    for s in ex.skipped:
        lines.append(f"{s.rule}{'' if s.engine is None else ' on ' + s.engine}: not expressible in PromQL ({s.why})")
    return "\n".join(lines) + ("\n" if lines else "")
