"""A comparison as text, Markdown or the stable JSON shape (docs/compare.md). Pure functions."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..numeric import json_number
from ..units import duration_text, fmt
from . import measures
from .verdict import change_text
from .workload import Check

if TYPE_CHECKING:
    from .api import Comparison
    from .sides import Side

JSON_SCHEMA_VERSION = 1


def _side_line(c: "Comparison", role: str) -> str:
    side, diag = (c.before, c.before_diag) if role == "before" else (c.after, c.after_diag)
    n = len(diag.incidents)
    inc = "no incident" if not n else f"{n} incident{'s' if n != 1 else ''}"
    return (f"{side.label} · {len(side.capture.requests):,} requests · {diag.time_label(diag.start_s)} → "
            f"{diag.time_label(diag.end_s)} ({duration_text(max(diag.end_s - diag.start_s, 0))}) · {inc}")


def check_cells(ch: Check) -> tuple[str, str, str, str]:
    if ch.name == "arrival_rate":
        b, a = (f"{x['rate_per_s']:.3g} req/s" if math.isfinite(x["rate_per_s"]) else "n/a" for x in (ch.before, ch.after))
        test = f"ratio {ch.statistic:.2f}, p {ch.p_value:.2g}" if ch.statistic is not None else ""
    elif ch.name == "concurrency":
        b, a = (f"mean {x['mean_in_flight']:.1f} · P95 {x['p95']:.0f}" if x["n"] else "n/a" for x in (ch.before, ch.after))
        test = f"ratio {ch.statistic:.2f}" if ch.statistic is not None else ""
    elif ch.before.get("n") and ch.after.get("n"):
        unit = "" if ch.name == "turn" else " tok"
        b, a = (f"P50 {x['p50']:,.0f} · P95 {x['p95']:,.0f}{unit}" for x in (ch.before, ch.after))
        test = f"KS D {ch.statistic:.2f}, p {ch.p_value:.2g}" if ch.statistic is not None else ""
    else:
        b = a = "not recorded"
        test = ""
    differs = "YES" if ch.differs else ("no" if ch.compared else "—")
    if ch.note and not ch.differs and not ch.compared:
        test = (test + "; " if test else "") + ch.note
    return b, a, test, differs


def matching_line(c: "Comparison") -> str | None:
    m = c.workload.matching
    if m is None:
        return None
    used = [b for b in m.buckets if b["matched"]]
    ranges = ", ".join("{:,.0f}–{:,.0f}".format(b["lo"], b["hi"]) for b in used)
    return (f"Matched prompt-length buckets: {len(used)} of {len(m.buckets)} ({ranges} tokens), covering "
            f"{m.coverage_before:.0%} of requests before and {m.coverage_after:.0%} after; "
            "latency percentiles are standardised to their pooled mix")


def _family(c: "Comparison") -> list:
    """Every signal judged, once by name: the headline signals and the rules' impact signals."""
    return list({d.name: d for d in [*c.signals, *(r.impact for r in c.rules if r.impact)]}.values())


def _footer(c: "Comparison") -> str:
    k = sum(1 for d in _family(c) if math.isfinite(d.p_adjusted))
    return (f"Intervals: 95%, {c.resamples:,} bootstrap resamples (seed {c.seed}); a signal is better or worse only "
            f"when its change is significant after Holm's correction over the {k} signals tested (family-wise "
            f"error {measures.S.FAMILY_ALPHA:.0%}) and at least {measures.MIN_REL_CHANGE:.0%}.")


def _rule_lines(c: "Comparison") -> list[str]:
    out = []
    for r in c.rules:
        b = f"before {r.confidence_before:.0%}: {r.cause_before}" if r.fired_before else "before: did not fire"
        a = f"after {r.confidence_after:.0%}: {r.cause_after}" if r.fired_after else "after: did not fire"
        out.append(f"  {r.status:<13} {r.rule.id}: {r.rule.title}")
        out.append(f"  {'':<13} {b} · {a}")
        if r.impact is not None:
            d = r.impact
            out.append(f"  {'':<13} impact {d.name}: {fmt(d.before, d.unit)} → {fmt(d.after, d.unit)}, "
                       f"{change_text(d)} ({d.verdict})")
        ev = " · ".join(f"{n} {fmt(b_, u)} → {fmt(a_, u)}" for n, b_, a_, u in r.evidence
                        if math.isfinite(b_) or math.isfinite(a_))
        if ev:
            out.append(f"  {'':<13} {ev}")
        if r.note:
            out.append(f"  {'':<13} note: {r.note}")
    return out


def text(c: "Comparison") -> str:
    lines = list(c.lines)
    lines += [f"before: {_side_line(c, 'before')}", f"after:  {_side_line(c, 'after')}", ""]
    if c.rules:
        lines.append("Rules that fired on either side")
        lines += _rule_lines(c)
    else:
        lines.append("Rules: none fired on either side")
    lines += ["", f"{'Signals':<22}{'before':>12}{'after':>12}   {'change [95% CI]':<30}verdict"]
    for d in c.signals:
        verdict = d.verdict + ("" if d.comparable else f" (not comparable: {d.note})")
        lines.append(f"  {d.label:<20}{fmt(d.before, d.unit):>12}{fmt(d.after, d.unit):>12}   "
                     f"{change_text(d) if d.verdict != 'n/a' or d.iv else '':<30}{verdict}")
    lines += ["", f"{'Workload':<22}{'before':<28}{'after':<28}{'differs':<9}test"]
    for ch in c.workload.checks:
        b, a, test, differs = check_cells(ch)
        lines.append(f"  {ch.label:<20}{b:<28}{a:<28}{differs:<9}{test}")
    m = matching_line(c)
    if m:
        lines.append(m)
    lines += ["", _footer(c)]
    return "\n".join(lines) + "\n"


def _md(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def markdown(c: "Comparison") -> str:
    out = [f"**{_md(line)}**" if i == 0 else _md(line) for i, line in enumerate(c.lines)]
    out = ["\n\n".join(out), "",
           f"- before: `{_md(c.before.label)}` · {_md(_side_line(c, 'before').split(' · ', 1)[1])}",
           f"- after: `{_md(c.after.label)}` · {_md(_side_line(c, 'after').split(' · ', 1)[1])}", "",
           "## Rules", ""]
    if c.rules:
        out += ["| status | rule | before | after | impact | change [95% CI] |", "|---|---|---|---|---|---|"]
        for r in c.rules:
            d = r.impact
            out.append(f"| {r.status} | `{_md(r.rule.id)}` | {f'{r.confidence_before:.0%}' if r.fired_before else '—'} | "
                       f"{f'{r.confidence_after:.0%}' if r.fired_after else '—'} | "
                       + (f"{_md(d.name)} {_md(fmt(d.before, d.unit))} → {_md(fmt(d.after, d.unit))} | {_md(change_text(d))} |"
                          if d else "| |"))
    else:
        out.append("No rule fired on either side.")
    out += ["", "## Signals", "", "| signal | before | after | change [95% CI] | verdict |", "|---|---:|---:|---|---|"]
    for d in c.signals:
        verdict = d.verdict + ("" if d.comparable else f" (not comparable: {d.note})")
        out.append(f"| {_md(d.label)} | {_md(fmt(d.before, d.unit))} | {_md(fmt(d.after, d.unit))} | "
                   f"{_md(change_text(d)) if d.iv else ''} | {_md(verdict)} |")
    out += ["", "## Workload", "", "| dimension | before | after | test | differs |", "|---|---|---|---|---|"]
    for ch in c.workload.checks:
        out.append("| " + " | ".join(_md(x) for x in (ch.label, *check_cells(ch))) + " |")
    m = matching_line(c)
    if m:
        out += ["", _md(m)]
    out += ["", _md(_footer(c))]
    return "\n".join(out) + "\n"


def _iv_json(d) -> dict[str, Any]:
    iv = d.iv
    return {
        "diff": json_number(iv.diff) if iv else None,
        "diff_ci": [json_number(iv.diff_lo), json_number(iv.diff_hi)] if iv and math.isfinite(iv.diff_lo) else None,
        "rel": json_number(iv.rel) if iv else None,
        "rel_ci": [json_number(iv.rel_lo), json_number(iv.rel_hi)] if iv and math.isfinite(iv.rel_lo) else None,
        "p_value": json_number(iv.p) if iv else None,
        "p_adjusted": json_number(d.p_adjusted),
    }


def _signal_json(d) -> dict[str, Any]:
    return {"name": d.name, "label": d.label, "unit": d.unit, "better": d.better, "before": json_number(d.before),
            "after": json_number(d.after), **_iv_json(d), "verdict": d.verdict, "text": change_text(d) if d.iv else None,
            "method": d.method, "matched": d.matched, "comparable": d.comparable, "note": d.note or None}


def _side_json(side: "Side", diag) -> dict[str, Any]:
    return {"spec": side.label, "path": str(side.spec.path), "since_s": json_number(side.since_s), "until_s": json_number(side.until_s),
            "requests": len(side.capture.requests), "start": diag.time_label(diag.start_s), "end": diag.time_label(diag.end_s),
            "start_s": json_number(diag.start_s), "end_s": json_number(diag.end_s), "engine": side.capture.meta.engine,
            "model": side.capture.meta.model, "incidents": len(diag.incidents), "warnings": list(diag.warnings)}


def to_json(c: "Comparison") -> dict[str, Any]:
    wl = c.workload
    m = wl.matching
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "lines": c.lines,
        "headline": c.overall.headline,
        "verdict": c.overall.verdict,
        "verdict_within_matched": c.overall.verdict_within_matched,
        "wins": c.overall.wins,
        "costs": c.overall.costs,
        "before": _side_json(c.before, c.before_diag),
        "after": _side_json(c.after, c.after_diag),
        "workload": {
            "differs": wl.differs,
            "load_differs": wl.load_differs,
            "closed_loop": wl.closed_loop,
            "first_line": wl.first_line(),
            "checks": [{"name": ch.name, "label": ch.label,
                        "before": {k: json_number(v) for k, v in ch.before.items()},
                        "after": {k: json_number(v) for k, v in ch.after.items()},
                        "statistic": json_number(ch.statistic), "p_value": json_number(ch.p_value), "differs": ch.differs,
                        "compared": ch.compared, "note": ch.note or None} for ch in wl.checks],
            "matching": None if m is None else {
                "buckets": m.buckets, "coverage_before": json_number(m.coverage_before), "coverage_after": json_number(m.coverage_after),
                "share": [json_number(x) for x in m.share]},
        },
        "rules": [{"rule": r.rule.id, "title": r.rule.title, "status": r.status,
                   "fired_before": r.fired_before, "fired_after": r.fired_after,
                   "confidence_before": json_number(r.confidence_before), "confidence_after": json_number(r.confidence_after),
                   "cause_before": r.cause_before, "cause_after": r.cause_after,
                   "impact": _signal_json(r.impact) if r.impact else None,
                   "evidence": {n: {"before": json_number(b), "after": json_number(a), "unit": u} for n, b, a, u in r.evidence},
                   "note": r.note or None} for r in c.rules],
        "signals": [_signal_json(d) for d in c.signals],
        "method": {"resamples": c.resamples, "seed": c.seed, "confidence": 0.95,
                   "min_rel_change": measures.MIN_REL_CHANGE, "family_correction": "holm",
                   "family_alpha": measures.S.FAMILY_ALPHA,
                   "family_size": sum(1 for d in _family(c) if math.isfinite(d.p_adjusted))},
    }
