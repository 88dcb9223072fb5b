"""Text renderings of a diagnosis: the on-call summary (short, phone-readable), the full text
and Markdown. Pure functions of a Diagnosis; no I/O."""
from __future__ import annotations

import math

from ..diagnosis import Diagnosis, Incident
from ..engines.labels import ENGINE_KNOB, ENGINE_LABEL  # noqa: F401  (renderers import them from here)
from ..signals import REGISTRY
from ..units import duration_text, fmt  # noqa: F401  (one formatter for every renderer)

def _measured(v: float | None) -> bool:
    return v is not None and not (isinstance(v, float) and (math.isnan(v) or math.isinf(v)))


def _known(evidence: dict[str, float]) -> list[tuple[str, float]]:
    """Evidence with a value, in the rule's order."""
    return [(k, v) for k, v in evidence.items() if _measured(v)]


def _not_measured(evidence: dict[str, float]) -> list[str]:
    return [k for k, v in evidence.items() if not _measured(v)]


def evidence_lines(evidence: dict[str, float]) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(measured readings as (name, value text), counts that are zero, names not measured): renderers
    show readings one a line, then the zero counts and the unmeasured names one line each, so an
    unmeasured signal never reads like a measured 'n/a'."""
    shown, zero = [], []
    for k, v in _known(evidence):
        if v == 0 and REGISTRY[k].unit == "count":
            zero.append(k)
        else:
            shown.append((k, fmt(v, REGISTRY[k].unit)))
    return shown, zero, _not_measured(evidence)


def _evidence_line(name: str, value: float) -> str:
    return f"{name} = {fmt(value, REGISTRY[name].unit)}"


def engine_key(diag: Diagnosis) -> str | None:
    return ENGINE_KNOB.get((diag.capture.meta.engine or "").lower())


def _knobs(knobs: dict[str, str], engine: str | None, limit: int = 2) -> list[str]:
    if engine and engine in knobs:
        return [f"{ENGINE_LABEL[engine]}: {knobs[engine]}"]
    keys = (["any"] if "any" in knobs else []) + [k for k in knobs if k != "any"]
    return [f"{ENGINE_LABEL[k]}: {knobs[k]}" for k in keys[:limit]]


_MD_SPECIAL = str.maketrans({c: "\\" + c for c in "\\`*_{}[]()#+-.!|<>~"} | {"\n": " ", "\r": " "})


def md_escape(text: object) -> str:
    """Text from a capture (paths, model names, source details) as literal Markdown: no markup,
    links, HTML or table breaks can come in through it."""
    return str(text).translate(_MD_SPECIAL)


def _header(diag: Diagnosis, esc=str) -> list[str]:
    """The header lines; ``esc`` escapes the values that come from the capture (Markdown)."""
    meta = diag.capture.meta
    span = max(diag.end_s - diag.start_s, 0)
    when = (f"{diag.time_label(diag.start_s)} → {diag.time_label(diag.end_s)} ({duration_text(span)})"
            if diag.arrivals_known else "arrival times unknown")
    lines = [f"kvdoctor · {esc(diag.capture.path)} · {len(diag.capture.requests):,} requests · {when}"]
    what = " · ".join(x for x in (meta.engine and f"engine {esc(meta.engine)}", meta.model and f"model {esc(meta.model)}",
                                  meta.gpu and f"GPU {esc(meta.gpu)}") if x)
    if what:
        lines.append(what)
    missing = [k for k, v in meta.sources.items() if not v.ok]
    if missing:
        lines.append("not read: " + ", ".join(f"{esc(k)} ({esc(meta.sources[k].detail)})" for k in missing))
    if diag.context_limit_tokens and diag.context_limit_source != "engine info in the capture":
        lines.append(f"context limit: {diag.context_limit_tokens:,.0f} tokens, from {esc(diag.context_limit_source)}")
    for w in diag.warnings:
        lines.append(f"warning: {esc(w)}")
    return lines


def _not_evaluated(diag: Diagnosis) -> list[str]:
    """The rules that could not fire on this capture and what they lacked (kvdoctor/diagnosis/coverage.py)."""
    from ..diagnosis.coverage import not_evaluated_line

    line = not_evaluated_line(getattr(diag, "not_evaluated", []))
    return [line] if line else []


def _when(diag: Diagnosis, inc: Incident) -> str:
    if not diag.arrivals_known:
        return "requests " + f"{diag.time_label(inc.start_s)} → {diag.time_label(inc.end_s)}".replace("#", "")
    return f"{diag.time_label(inc.start_s)} → {diag.time_label(inc.end_s)} ({duration_text(inc.end_s - inc.start_s)})"


def _impact(inc: Incident) -> str:
    parts = [f"{inc.impact.get('requests', 0):,} requests"]
    if inc.impact.get("errors"):
        parts.append(f"{inc.impact['errors']:,} failed")
    sig = inc.impact.get("signal")
    if sig:
        val = fmt(inc.impact.get("value"), REGISTRY[sig].unit)
        slo = inc.impact.get("slo")
        parts.append(f"{sig} = {val}" + (f" (SLO {fmt(slo, REGISTRY[sig].unit)})" if slo is not None else ""))
    return "; ".join(parts)


def summary_text(diag: Diagnosis, max_evidence: int = 4) -> str:
    """The on-call text: what, when, impact, likely cause with evidence, first fix."""
    lines = _header(diag)
    engine = engine_key(diag)
    if not diag.incidents:
        lines.append("")
        lines.append("No incident: no rule fired. " + _healthy_line(diag))
        return "\n".join(lines + _not_evaluated(diag)) + "\n"
    for n, inc in enumerate(diag.incidents, 1):
        top = inc.causes[0]
        lines += [
            "",
            f"[{n}] {inc.severity.upper()} {inc.symptom} · {_when(diag, inc)}",
            f"What: {top.rule.title}",
            f"Impact: {_impact(inc)}",
            f"Likely cause ({top.confidence:.0%}, rule {top.rule.id}{top.rule.tag}): {top.cause}",
            "Evidence: " + " · ".join(f"{k} = {v}" for k, v in evidence_lines(top.evidence)[0][:max_evidence]),
        ]
        unmeasured = _not_measured(top.evidence)
        if unmeasured:
            lines.append("Not measured: " + ", ".join(unmeasured))
        lines += [
            f"First fix: {top.fixes[0].title}",
        ]
        lines += [f"  {k}" for k in _knobs(top.fixes[0].knobs, engine)]
        if len(inc.causes) > 1:
            lines.append("Also considered: " + ", ".join(f"{c.rule.id} ({c.confidence:.0%}){c.rule.tag}" for c in inc.causes[1:4]))
    return "\n".join(lines + [""] + _not_evaluated(diag)) + "\n"


def _healthy_line(diag: Diagnosis) -> str:
    from ..signals import Prepared

    w = (diag.prepared or Prepared(diag.capture)).window(diag.start_s, diag.end_s)
    keys = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "error_rate", "prompt_p50_tokens",
            "prompt_p99_tokens", "prefix_hit_rate_achievable", "request_rate_per_s")
    parts = [_evidence_line(k, w.value(k)) for k in keys if not math.isnan(w.value(k))]
    note = "" if not math.isnan(w.value("ttft_p50_s")) else " (no latencies in this capture: workload only)"
    return " · ".join(parts) + note


def full_text(diag: Diagnosis) -> str:
    """Every incident with every cause, all evidence and all fixes."""
    lines = _header(diag)
    engine = engine_key(diag)
    if not diag.incidents:
        return "\n".join(lines + ["", "No incident: no rule fired. " + _healthy_line(diag)] + _not_evaluated(diag)) + "\n"
    for n, inc in enumerate(diag.incidents, 1):
        lines += ["", f"Incident {n}: {inc.severity.upper()} {inc.symptom}, {_when(diag, inc)}",
                  f"  impact: {_impact(inc)}"]
        for rank, c in enumerate(inc.causes, 1):
            lines.append(f"  {rank}. {c.rule.id} ({c.confidence:.0%}): {c.rule.title}{c.rule.tag}")
            lines.append(f"     cause: {c.cause}")
            shown, zero, unmeasured = evidence_lines(c.evidence)
            lines += [f"     - {k} = {v}" for k, v in shown]
            if zero:
                lines.append(f"     - zero: {', '.join(zero)}")
            if unmeasured:
                lines.append(f"     not measured: {', '.join(unmeasured)}")
            for f in c.fixes:
                lines.append(f"     fix: {f.title}")
                lines += [f"       {k}" for k in _knobs(f.knobs, engine, limit=5)]
    return "\n".join(lines + [""] + _not_evaluated(diag)) + "\n"


def markdown(diag: Diagnosis) -> str:
    out = ["# kvdoctor diagnosis", "", *[f"- {x}" for x in _header(diag, md_escape)], ""]
    if not diag.incidents:
        return "\n".join(out + ["**No incident**: no rule fired. " + _healthy_line(diag), ""]
                         + [f"_{x}_" for x in _not_evaluated(diag)] + [""] * bool(_not_evaluated(diag)))
    engine = engine_key(diag)
    for n, inc in enumerate(diag.incidents, 1):
        top = inc.causes[0]
        out += [f"## {n}. {top.rule.title}", "",
                f"**{inc.severity}** · symptom `{inc.symptom}` · {_when(diag, inc)} · {_impact(inc)}", "",
                "| rank | rule | confidence | cause |", "|---|---|---|---|"]
        out += [f"| {i} | `{c.rule.id}`{c.rule.tag} | {c.confidence:.0%} | {c.cause} |" for i, c in enumerate(inc.causes, 1)]
        shown, zero, unmeasured = evidence_lines(top.evidence)
        out += ["", "**Evidence**", ""] + [f"- `{k}` = {v}" for k, v in shown]
        if zero:
            out.append("- zero: " + ", ".join(f"`{k}`" for k in zero))
        if unmeasured:
            out += ["", "Not measured: " + ", ".join(f"`{k}`" for k in unmeasured)]
        out += ["", "**Fixes, in order**", ""]
        for f in top.fixes:
            out.append(f"1. {f.title}" + (f" — {f.why}" if f.why else ""))
            out += [f"   - {k}" for k in _knobs(f.knobs, engine, limit=5)]
        out.append("")
    out += [f"_{x}_" for x in _not_evaluated(diag)] + [""] * bool(_not_evaluated(diag))
    return "\n".join(out)


def live_incident_text(inc: Incident, what: str, engine: str | None) -> str:
    """A live incident as the sidecar prints it and posts it to a webhook (Slack text)."""
    top = inc.top
    if what == "closed":
        return (f"RESOLVED #{inc.id} {inc.symptom}: {top.rule.title}{top.rule.tag} "
                f"(open {duration_text((inc.closed_s or inc.end_s) - inc.start_s)})")
    lines = [f"INCIDENT #{inc.id} {inc.severity.upper()} {inc.symptom}: {top.rule.title}",
             f"Likely cause ({top.confidence:.0%}, rule {top.rule.id}{top.rule.tag}): {top.cause}",
             "Evidence: " + " · ".join(_evidence_line(k, v) for k, v in _known(top.evidence)[:4]),
             f"First fix: {top.fixes[0].title}"]
    lines += [f"  {k}" for k in _knobs(top.fixes[0].knobs, ENGINE_KNOB.get((engine or "").lower()))]
    if len(inc.causes) > 1:
        lines.append("Also: " + ", ".join(f"{c.rule.id} ({c.confidence:.0%}){c.rule.tag}" for c in inc.causes[1:4]))
    return "\n".join(lines)
