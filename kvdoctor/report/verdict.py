"""The first three lines of every output: what happened and since when, the likely cause, and
the first fix for the recorded engine; then where it was found. An on-call engineer who reads
only these knows what to do. Pure functions of a Diagnosis."""
from __future__ import annotations

from typing import Callable

from ..diagnosis import Diagnosis, Incident
from ..diagnosis.incident import Breach, CauseFinding
from ..engines.labels import ENGINE_KNOB, ENGINE_LABEL
from ..units import duration_text, fmt, target_text


def engine_key(diag: Diagnosis) -> str | None:
    """The knob key of the capture's engine (vllm, llamacpp, ...); None when unknown."""
    return ENGINE_KNOB.get((diag.capture.meta.engine or "").lower())


def applicable(fixes, engine: str | None) -> list:
    """The fixes this engine can apply: those with a knob for it or for any engine. An engine
    without a fix's feature (llama.cpp has no disaggregation) never sees it; with the engine
    unknown, every fix stays."""
    if not engine:
        return list(fixes)
    return [f for f in fixes if (engine in f.knobs or "any" in f.knobs) and f.possible_on(engine)]


def knob_lines(knobs: dict[str, str], engine: str | None, limit: int = 2) -> list[str]:
    """The knob(s) to show: only the engine's own when it is known (else "any engine"); with the
    engine unknown, the generic one then each engine's, up to ``limit``."""
    if engine:
        if engine in knobs:
            return [f"{ENGINE_LABEL[engine]}: {knobs[engine]}"]
        return [f"{ENGINE_LABEL['any']}: {knobs['any']}"] if "any" in knobs else []
    keys = (["any"] if "any" in knobs else []) + [k for k in knobs if k != "any"]
    return [f"{ENGINE_LABEL[k]}: {knobs[k]}" for k in keys[:limit]]


def breach_text(b: Breach) -> str:
    """'TTFT P99 5.31 s over the 2 s objective (32 of 48 requests)'."""
    o, r = b.objective, b.reading
    what = "failed" if o.percentile is None else "over"
    count = f"{r.over:,} of {r.total:,} {'gaps' if o.kind == 'itl' else 'requests'} {what}"
    if r.cut:
        count += f", {r.cut:,} of them cut at the context limit"
    default = f"; {o.source.removeprefix('default (').removesuffix(')')} default" if not o.stated else ""
    return (f"{o.label} {fmt(r.measured, o.unit)} over the {target_text(o.target, o.unit)} objective "
            f"({count}{default})")


def what_text(inc: Incident) -> str:
    """What happened: the worst broken objective, else the top rule's title."""
    if inc.breaches:
        return breach_text(inc.breaches[0])
    return inc.top.rule.title


def cause_text(c: CauseFinding) -> str:
    return f"{c.cause} ({c.rule.id}{c.rule.tag}, {c.confidence:.0%})"


def since_text(diag: Diagnosis, inc: Incident) -> str:
    if not diag.arrivals_known:
        return f"requests {diag.time_label(inc.start_s)}-{diag.time_label(inc.end_s)}".replace("#", "")
    ongoing = inc.end_s >= diag.end_s - 1e-6
    span = duration_text(max(inc.end_s - inc.start_s, 0))
    return f"since {diag.time_label(inc.start_s)} ({span}{', to the end of the capture' if ongoing else ''})"


def first_step(c: CauseFinding, engine: str | None) -> str:
    """The first thing to do for a cause: measure first where it is a hypothesis, else its first
    fix for this engine."""
    if c.measure:
        return f"First step (the cause is a hypothesis): {c.measure}"
    fixes = applicable(c.fixes, engine)
    if not fixes:
        on = "; ".join(f"{f.title} is already on{': ' + f.if_in_effect if f.if_in_effect else ''}" for f in c.in_effect)
        return f"No fix to add for this engine{': ' + on if on else ''}"
    f = fixes[0]
    knobs = knob_lines(f.knobs, engine, limit=3)
    if engine:
        return f"First fix for {ENGINE_LABEL[engine]}: {f.title}" + (f" — {knobs[0].split(': ', 1)[1]}" if knobs else "")
    return f"First fix (engine unknown, so every engine's knob; pass --engine): {f.title}" + (
        f" — {'; '.join(knobs)}" if knobs else "")


def context_line(diag: Diagnosis, esc: Callable[[object], str] = str, with_model: bool = True) -> str:
    """Where and what: the capture, engine, size, span and the objectives judged."""
    meta = diag.capture.meta
    engine = engine_key(diag)
    parts = [f"kvdoctor · {esc(diag.capture.path)}",
             ENGINE_LABEL[engine] + (f" {esc(meta.engine_version)}" if getattr(meta, "engine_version", None) else "")
             if engine else "engine unknown"]
    if meta.model and with_model:
        parts.append(esc(meta.model))
    parts.append(f"{len(diag.capture.requests):,} requests")
    if diag.arrivals_known:
        parts.append(f"{diag.time_label(diag.start_s)} → {diag.time_label(diag.end_s)} "
                     f"({duration_text(max(diag.end_s - diag.start_s, 0))})")
    else:
        parts.append("arrival times unknown")
    parts.append(objectives_text(diag))
    return " · ".join(parts)


def objectives_text(diag: Diagnosis) -> str:
    objs = diag.options.objectives or ()
    if not objs:
        return "no objectives judged"
    stated = [o for o in objs if o.stated]
    items = ", ".join(f"{o.label} ≤ {target_text(o.target, o.unit)}" for o in objs)
    if not stated:
        return f"objectives: {diag.options.workload} defaults ({items})"
    return f"objectives: {items}" + (f" ({diag.options.workload} defaults for the rest)"
                                     if len(stated) < len(objs) else "")


def headline(diag: Diagnosis, esc: Callable[[object], str] = str, with_model: bool = True) -> list[str]:
    """Exactly three lines: the verdict, the first step, and the context."""
    engine = engine_key(diag)
    if diag.nothing_to_diagnose:
        return [f"NOTHING TO DIAGNOSE: {esc(diag.nothing_to_diagnose)}",
                "Check the range asked for (--since/--until) and that the server was up and reachable while recording",
                context_line(diag, esc, with_model)]
    pages = [i for i in diag.incidents if not i.observation]
    notes = [i for i in diag.incidents if i.observation]
    if pages:
        top = pages[0]
        l1 = f"{top.severity.upper()} {since_text(diag, top)}: {what_text(top)} — likely cause: {cause_text(top.top)}"
        more = []
        if len(pages) > 1:
            more.append(f"{len(pages) - 1} more incident{'s' * (len(pages) > 2)}")
        if notes:
            more.append(f"{len(notes)} observation{'s' * (len(notes) > 1)}")
        l3 = context_line(diag, esc, with_model) + (f" · {', '.join(more)} below" if more else "")
        return [l1, first_step(top.top, engine), l3]
    k = diag.key_numbers
    checks = "; ".join(f"{c.objective.label} {fmt(c.measured, c.objective.unit)} "
                       f"(objective {target_text(c.objective.target, c.objective.unit)})" for c in k.checks)
    l1 = "OK: no objective broken and no user waiting beyond the server's own work" + (f" — {checks}" if checks else "")
    if notes:
        l2 = "Observations, nothing to fix while they hurt nobody: " + "; ".join(
            f"{n.top.rule.id} ({n.top.cause})" for n in notes[:3])
    else:
        l2 = "No rule fired" + (" (some could not be evaluated: see below)" if diag.not_evaluated else "")
    return [l1, l2, context_line(diag, esc, with_model)]
