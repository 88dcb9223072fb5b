"""Text renderings of a diagnosis: the on-call summary (short, phone-readable), the full text
and Markdown. Pure functions of a Diagnosis; no I/O."""
from __future__ import annotations

import math

from ..diagnosis import Diagnosis, Incident
from ..diagnosis.numbers import LATENCIES, QUANTILES
from ..engines.labels import ENGINE_KNOB
from ..signals import REGISTRY
from ..units import duration_text, fmt, target_text
from .labels import label, reading
from .verdict import applicable, breach_text, cause_text, engine_key, first_step, headline, knob_lines, what_text

def _measured(v: float | None) -> bool:
    return v is not None and not (isinstance(v, float) and (math.isnan(v) or math.isinf(v)))


def _known(evidence: dict[str, float]) -> list[tuple[str, float]]:
    """Evidence with a value, in the rule's order."""
    return [(k, v) for k, v in evidence.items() if _measured(v)]


def _not_measured(evidence: dict[str, float]) -> list[str]:
    return [k for k, v in evidence.items() if not _measured(v)]


def evidence_lines(evidence: dict[str, float], verbose: bool = False) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(measured readings as (label, value text), counts that are zero, names not measured):
    renderers show readings one a line, then the zero counts and the unmeasured names one line
    each, so an unmeasured signal never reads like a measured 'n/a'. Labels are what people read
    ("TTFT P99"); ``verbose`` adds the signal's identifier."""
    shown, zero = [], []
    for k, v in _known(evidence):
        name = f"{label(k)} [{k}]" if verbose else label(k)
        if v == 0 and REGISTRY[k].unit == "count":
            zero.append(name)
        else:
            shown.append((name, fmt(v, REGISTRY[k].unit)))
    return shown, zero, [f"{label(k)} [{k}]" if verbose else label(k) for k in _not_measured(evidence)]


def _knobs(knobs: dict[str, str], engine: str | None, limit: int = 2) -> list[str]:
    return knob_lines(knobs, engine, limit)


_MD_SPECIAL = str.maketrans({c: "\\" + c for c in "\\`*_{}[]()#+-.!|<>~"} | {"\n": " ", "\r": " "})


def md_escape(text: object) -> str:
    """Text from a capture (paths, model names, source details) as literal Markdown: no markup,
    links, HTML or table breaks can come in through it."""
    return str(text).translate(_MD_SPECIAL)


def details(diag: Diagnosis, esc=str) -> list[str]:
    """What the reader should know about the capture before trusting the numbers: sources that
    could not be read, where the context limit came from, and the warnings."""
    meta = diag.capture.meta
    lines = []
    missing = [k for k, v in meta.sources.items() if not v.ok]
    if missing:
        lines.append("not read: " + ", ".join(f"{esc(k)} ({esc(meta.sources[k].detail)})" for k in missing))
    if diag.context_limit_tokens and diag.context_limit_source != "engine info in the capture":
        lines.append(f"context limit: {diag.context_limit_tokens:,.0f} tokens, from {esc(diag.context_limit_source)}")
    for w in diag.warnings:
        lines.append(f"warning: {esc(w)}")
    return lines


def key_numbers_lines(diag: Diagnosis) -> list[str]:
    """The key-numbers table: latency percentiles with the objective beside each, then volume and
    errors. A broken objective is marked BROKEN with how many requests were over it."""
    k = diag.key_numbers
    rows = [("", "P50", "P90", "P99", "objective")]
    for key, name, _ in LATENCIES:
        vals = k.latency_s.get(key, {})
        if not any(_measured(v) for v in vals.values()):
            continue
        obj = []
        for c in k.check_for(key):
            o = c.objective
            mark = f" BROKEN ({c.over:,}/{c.total:,} over)" if c.broken else ""
            obj.append(f"P{o.percentile} <= {target_text(o.target, 's')}{f' on {o.route}' if o.route else ''}{mark}")
        rows.append((name, *(fmt(vals.get(q), "s") for q in QUANTILES), "; ".join(obj) or "-"))
    out = []
    if len(rows) > 1:
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        out = ["Key numbers:"] + ["  " + "  ".join(c.rjust(widths[i]) if 0 < i < 4 else c.ljust(widths[i])
                                                   for i, c in enumerate(r)).rstrip() for r in rows]
    parts = [f"{k.requests:,} requests"]
    if _measured(k.duration_s):
        parts.append(f"over {duration_text(k.duration_s)}")
    if _measured(k.request_rate_per_s):
        parts.append(fmt(k.request_rate_per_s, "1/s"))
    if _measured(k.output_tokens_per_s) and k.output_tokens_per_s > 0:
        parts.append(f"{fmt(k.output_tokens_per_s, 'tokens/s')} out")
    if k.errors is not None:
        err = f"{k.errors:,} failed ({fmt(k.error_rate, 'fraction')})" if _measured(k.error_rate) else f"{k.errors:,} failed"
        if k.context_cut:
            err += f", {k.context_cut:,} cut at the context limit"
        for c in k.check_for("error_rate"):
            err += f"; objective <= {target_text(c.objective.target, 'fraction')}" + (" BROKEN" if c.broken else "")
        parts.append(err)
    out.append(("  " if out else "") + " · ".join(parts))
    return out


def not_evaluated_short(diag: Diagnosis, where: str = "kvdoctor diagnose lists them") -> list[str]:
    """One short line: how many rules could not run and the first things they lacked."""
    items = getattr(diag, "not_evaluated", [])
    if not items:
        return []
    needs = list(dict.fromkeys(n for item in items for n in item.needs))
    needs.sort(key=lambda n: "pass --" not in n)  # what the user can supply first
    text = "; ".join(needs)
    if len(text) > 110:
        text = text[:107].rsplit(";", 1)[0] + "; …"
    return [f"{len(items)} rule{'s' * (len(items) > 1)} not evaluated (needs {text}): {where}"]


def _not_evaluated(diag: Diagnosis) -> list[str]:
    """The rules that could not fire on this capture and what they lacked, in full."""
    from ..diagnosis.coverage import not_evaluated_line

    line = not_evaluated_line(getattr(diag, "not_evaluated", []))
    return [line] if line else []


def _when(diag: Diagnosis, inc: Incident) -> str:
    if not diag.arrivals_known:
        return "requests " + f"{diag.time_label(inc.start_s)} → {diag.time_label(inc.end_s)}".replace("#", "")
    return f"{diag.time_label(inc.start_s)} → {diag.time_label(inc.end_s)} ({duration_text(inc.end_s - inc.start_s)})"


def impact_text(inc: Incident) -> str:
    """Requests in the incident, failures, and its impact reading (with the objective when judged)."""
    parts = [f"{inc.impact.get('requests', 0):,} requests"]
    if inc.impact.get("errors"):
        parts.append(f"{inc.impact['errors']:,} failed")
    if inc.breaches:
        parts += [breach_text(b) for b in inc.breaches]
    else:
        sig = inc.impact.get("signal")
        if sig:
            parts.append(reading(sig, inc.impact.get("value")))
    return "; ".join(parts)


def _fix_block(c, engine: str | None, limit: int, indent: str, first_only: bool) -> list[str]:
    fixes = applicable(c.fixes, engine)
    lines = []
    for f in fixes[:1] if first_only else fixes:
        lines.append(f"{indent}{'First fix' if first_only else 'fix'}: {f.title}")
        lines += [f"{indent}  {k}" for k in knob_lines(f.knobs, engine, limit=limit)]
    for f in c.in_effect:
        lines.append(f"{indent}already on: {f.title}" + (f" — {f.if_in_effect}" if f.if_in_effect else ""))
    if not engine and fixes:
        lines.append(f"{indent}(engine unknown: knobs for every engine; pass --engine on import)")
    return lines


def summary_text(diag: Diagnosis, max_evidence: int = 4, verbose: bool = False) -> str:
    """The on-call text: the verdict in three lines, the key numbers, then each incident (what,
    when, impact, likely cause with evidence, first fix) and the observations."""
    lines = headline(diag)
    engine = engine_key(diag)
    if diag.nothing_to_diagnose:
        return "\n".join(lines + [""] + details(diag)) + "\n"
    lines += [""] + key_numbers_lines(diag)
    extra = details(diag)
    if extra:
        lines += [""] + extra
    pages = [i for i in diag.incidents if not i.observation]
    notes = [i for i in diag.incidents if i.observation]
    for n, inc in enumerate(pages, 1):
        top = inc.top
        lines += [
            "",
            f"[{n}] {inc.severity.upper()} {inc.symptom} · {_when(diag, inc)}",
            f"What: {top.rule.title}",
            f"Impact: {impact_text(inc)}",
            f"Likely cause ({top.confidence:.0%}, rule {top.rule.id}{top.rule.tag}): {top.cause}",
            "Evidence: " + " · ".join(f"{k} {v}" for k, v in evidence_lines(top.evidence, verbose)[0][:max_evidence]),
        ]
        unmeasured = evidence_lines(top.evidence, verbose)[2]
        if unmeasured:
            lines.append("Not measured: " + ", ".join(unmeasured))
        if top.measure:
            lines.append(f"First step (a hypothesis): {top.measure}")
        lines += _fix_block(top, engine, 2, "", first_only=True)
        if len(inc.causes) > 1:
            lines.append("Also considered: " + ", ".join(f"{c.rule.id} ({c.confidence:.0%}){c.rule.tag}" for c in inc.causes[1:4]))
    if notes:
        lines += ["", "Observations (no objective broken, nobody waiting because of them):"]
        for inc in notes:
            top = inc.top
            ev = " · ".join(f"{k} {v}" for k, v in evidence_lines(top.evidence, verbose)[0][:3])
            lines.append(f"- {top.rule.id}{top.rule.tag} ({inc.symptom}, {_when(diag, inc)}): {top.cause}" + (f" — {ev}" if ev else ""))
    tail = _not_evaluated(diag) if verbose else not_evaluated_short(diag, "kvdoctor diagnose (or summary --verbose) lists them")
    return "\n".join(lines + ([""] + tail if tail else [])) + "\n"


def _healthy_line(diag: Diagnosis) -> str:
    from ..signals import Prepared

    w = (diag.prepared or Prepared(diag.capture)).window(diag.start_s, diag.end_s)
    keys = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "error_rate", "prompt_p50_tokens",
            "prompt_p99_tokens", "prefix_hit_rate_achievable", "request_rate_per_s")
    parts = [reading(k, w.value(k)) for k in keys if not math.isnan(w.value(k))]
    note = "" if not math.isnan(w.value("ttft_p50_s")) else " (no latencies in this capture: workload only)"
    return " · ".join(parts) + note


def full_text(diag: Diagnosis, verbose: bool = True) -> str:
    """Every incident and observation with every cause, all evidence and all fixes."""
    lines = headline(diag)
    engine = engine_key(diag)
    if diag.nothing_to_diagnose:
        return "\n".join(lines + [""] + details(diag)) + "\n"
    lines += [""] + key_numbers_lines(diag)
    extra = details(diag)
    if extra:
        lines += [""] + extra
    if not diag.incidents:
        lines += ["", "No incident: no rule fired. " + _healthy_line(diag)]
    for n, inc in enumerate(diag.incidents, 1):
        kind = "Observation" if inc.observation else "Incident"
        lines += ["", f"{kind} {n}: {inc.severity.upper()} {inc.symptom}, {_when(diag, inc)}",
                  f"  impact: {impact_text(inc)}"]
        for rank, c in enumerate(inc.causes, 1):
            sev = "" if c.effective_severity == inc.severity else f" [{c.effective_severity}]"
            lines.append(f"  {rank}. {c.rule.id} ({c.confidence:.0%}){sev}: {c.rule.title}{c.rule.tag}")
            lines.append(f"     cause: {c.cause}")
            shown, zero, unmeasured = evidence_lines(c.evidence, verbose)
            lines += [f"     - {k} {v}" for k, v in shown]
            if zero:
                lines.append(f"     - zero: {', '.join(zero)}")
            if unmeasured:
                lines.append(f"     not measured: {', '.join(unmeasured)}")
            if c.measure:
                lines.append(f"     first step (a hypothesis): {c.measure}")
            lines += _fix_block(c, engine, 5, "     ", first_only=False)
    return "\n".join(lines + [""] + _not_evaluated(diag)) + "\n"


def markdown(diag: Diagnosis) -> str:
    head = headline(diag, md_escape, with_model=False)  # the model is its own line below
    meta = diag.capture.meta
    about = [f"- {what} {md_escape(v)}" for what, v in (("engine", meta.engine), ("engine version", getattr(meta, "engine_version", None)),
                                                         ("model", meta.model), ("GPU", meta.gpu), ("server", meta.server)) if v]
    out = ["# kvdoctor diagnosis", "", f"**{head[0]}**", "", head[1], "", f"_{head[2]}_", "", *about, ""]
    if diag.nothing_to_diagnose:
        return "\n".join(out + [f"- {x}" for x in details(diag, md_escape)] + [""])
    out += ["```", *key_numbers_lines(diag), "```", ""]
    out += [f"- {x}" for x in details(diag, md_escape)] + [""] * bool(details(diag, md_escape))
    if not diag.incidents:
        return "\n".join(out + ["**No incident**: no rule fired. " + _healthy_line(diag), ""]
                         + [f"_{x}_" for x in _not_evaluated(diag)] + [""] * bool(_not_evaluated(diag)))
    engine = engine_key(diag)
    for n, inc in enumerate(diag.incidents, 1):
        top = inc.causes[0]
        kind = "Observation: " if inc.observation else ""
        out += [f"## {n}. {kind}{top.rule.title}", "",
                f"**{inc.severity}** · symptom `{inc.symptom}` · {_when(diag, inc)} · {impact_text(inc)}", "",
                "| rank | rule | confidence | cause |", "|---|---|---|---|"]
        out += [f"| {i} | `{c.rule.id}`{c.rule.tag} | {c.confidence:.0%} | {c.cause} |" for i, c in enumerate(inc.causes, 1)]
        shown, zero, unmeasured = evidence_lines(top.evidence)
        out += ["", "**Evidence**", ""] + [f"- {k} {v}" for k, v in shown]
        if zero:
            out.append("- zero: " + ", ".join(zero))
        if unmeasured:
            out += ["", "Not measured: " + ", ".join(unmeasured)]
        if top.measure:
            out += ["", f"**First step (a hypothesis):** {top.measure}"]
        out += ["", "**Fixes, in order**", ""]
        for f in applicable(top.fixes, engine):
            out.append(f"1. {f.title}" + (f" — {f.why}" if f.why else ""))
            out += [f"   - {k}" for k in knob_lines(f.knobs, engine, limit=5)]
        for f in top.in_effect:
            out.append(f"- already on: {f.title}" + (f" — {f.if_in_effect}" if f.if_in_effect else ""))
        out.append("")
    out += [f"_{x}_" for x in _not_evaluated(diag)] + [""] * bool(_not_evaluated(diag))
    return "\n".join(out)


def live_incident_text(inc: Incident, what: str, engine: str | None) -> str:
    """A live incident as the sidecar prints it and posts it to a webhook (Slack text): the same
    first lines as the summary's."""
    top = inc.top
    if what == "closed":
        return (f"RESOLVED #{inc.id} {inc.symptom}: {top.rule.title}{top.rule.tag} "
                f"(open {duration_text((inc.closed_s or inc.end_s) - inc.start_s)})")
    key = ENGINE_KNOB.get((engine or "").lower())
    head = "OBSERVATION" if inc.observation else "INCIDENT"
    lines = [f"{head} #{inc.id} {inc.severity.upper()} {inc.symptom}: {what_text(inc)} — likely cause: {cause_text(top)}",
             first_step(top, key),
             "Evidence: " + " · ".join(reading(k, v) for k, v in _known(top.evidence)[:4])]
    if len(inc.causes) > 1:
        lines.append("Also: " + ", ".join(f"{c.rule.id} ({c.confidence:.0%}){c.rule.tag}" for c in inc.causes[1:4]))
    return "\n".join(lines)
