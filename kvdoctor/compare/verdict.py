"""What became of each rule, and the one-line verdict: fixed / improved / trade-off /
regressed / no significant change (or withheld when the workloads differ).

A rule that fired on either side gets a status: *resolved* (fired before, not after), *new*
(after only), or, when it fired on both, *improved* / *worse* / *unchanged* judged on the rule's
impact signal and its interval. *not-evaluated*: it fired before but the after side has fewer
requests than the rule needs, so silence proves nothing.

A change that makes one signal better and another worse is a *trade-off*, never a win.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..diagnosis import Diagnosis, Rule
from ..signals import REGISTRY
from .measures import Ctx, SignalDiff, compare_signal
from .workload import Workload

STATUSES = ("resolved", "improved", "unchanged", "worse", "new", "not-evaluated")


@dataclass
class RuleStatus:
    rule: Rule
    status: str
    fired_before: bool
    fired_after: bool
    confidence_before: float | None
    confidence_after: float | None
    cause_before: str | None
    cause_after: str | None
    impact: SignalDiff | None
    evidence: list[tuple[str, float, float, str]] = field(default_factory=list)
    note: str = ""


def fired(diag: Diagnosis) -> dict[str, tuple[float, str]]:
    """Rule id -> (best confidence, cause) over every incident's causes."""
    out: dict[str, tuple[float, str]] = {}
    for inc in diag.incidents:
        for c in inc.causes:
            if c.rule.id not in out or c.confidence > out[c.rule.id][0]:
                out[c.rule.id] = (c.confidence, c.cause)
    return out


def rule_impacts(before: Diagnosis, after: Diagnosis, ctx: Ctx, signals: list[SignalDiff]) -> dict[str, SignalDiff]:
    """Rule id -> its impact signal compared, for every rule that fired on either side (a headline
    signal's comparison is reused, so one signal is one test of the family)."""
    fb, fa = fired(before), fired(after)
    rules = {r.id: r for r in before.rules}
    rules.update({r.id: r for r in after.rules})
    known = {d.name: d for d in signals}
    out: dict[str, SignalDiff] = {}
    for rid in sorted(set(fb) | set(fa)):
        name = rules[rid].impact
        if name:
            known.setdefault(name, compare_signal(name, ctx))
            out[rid] = known[name]
    return out


def rule_statuses(before: Diagnosis, after: Diagnosis, ctx: Ctx, impacts: dict[str, SignalDiff]) -> list[RuleStatus]:
    """Statuses of the rules that fired on either side; ``impacts`` from :func:`rule_impacts`,
    judged with the family's correction."""
    fb, fa = fired(before), fired(after)
    rules = {r.id: r for r in before.rules}
    rules.update({r.id: r for r in after.rules})
    out = []
    for rid in sorted(set(fb) | set(fa)):
        rule = rules[rid]
        impact = impacts.get(rid)
        ev = [(name, ctx.wb.value(name), ctx.wa.value(name), REGISTRY[name].unit) for name in rule.evidence]
        b, a = fb.get(rid), fa.get(rid)
        note = ""
        if b and not a:
            if ctx.wa.n_requests < rule.min_requests:
                status = "not-evaluated"
                note = f"the after side has {ctx.wa.n_requests} requests; the rule needs {rule.min_requests}"
            else:
                status = "resolved"
        elif a and not b:
            status = "new"
        else:
            v = impact.verdict if impact else "no significant change"
            status = {"better": "improved", "worse": "worse"}.get(v, "unchanged")
        out.append(RuleStatus(rule, status, bool(b), bool(a), b[0] if b else None, a[0] if a else None,
                              b[1] if b else None, a[1] if a else None, impact, ev, note))
    order = {s: i for i, s in enumerate(STATUSES)}
    out.sort(key=lambda r: (order[r.status], r.rule.kind == "objective", r.rule.id))  # causes before the objectives they broke
    return out


# -- text of one change -------------------------------------------------------------------


def _pts(v: float) -> str:
    return f"{v * 100:+.1f}" if abs(v) < 0.1 else f"{v * 100:+.0f}"


def _pct(v: float) -> str:
    if not math.isfinite(v):
        return "new" if v > 0 else "n/a"
    if 0.995 <= abs(v) < 1:
        return f"{v * 100:+.1f}%"
    return f"{v * 100:+.0f}%" if abs(v) >= 0.1 else f"{v * 100:+.1f}%"


def _factor(v: float) -> str:
    f = 1 + v
    if not math.isfinite(f):
        return "n/a"
    return f"{f:.2f}x" if f < 10 else f"{f:,.0f}x"


def relative(d: SignalDiff) -> bool:
    """Changes of fractions and rates of change read as points; the rest as percent."""
    return d.unit not in ("fraction", "fraction/turn", "fraction/min")


def change_text(d: SignalDiff, with_ci: bool = True) -> str:
    """'-62% [CI -70%, -55%]' or '+85 pts [CI +80, +89]' (no CI part when there is none)."""
    iv = d.iv
    if iv is None or not math.isfinite(iv.diff):
        return "n/a"
    unit_pts = " pts" + ("/turn" if d.unit == "fraction/turn" else "")
    if relative(d) and math.isfinite(iv.rel):
        show = _factor if iv.rel >= 1 else _pct  # +17,438% reads better as 175x
        main = show(iv.rel)
        ci = f" [CI {show(iv.rel_lo)}, {show(iv.rel_hi)}]" if math.isfinite(iv.rel_lo) else ""
    else:
        main = _pts(iv.diff) + unit_pts
        ci = f" [CI {_pts(iv.diff_lo)}, {_pts(iv.diff_hi)}]" if math.isfinite(iv.diff_lo) else ""
    return main + (ci if with_ci else "")


def signal_phrase(d: SignalDiff) -> str:
    return f"{d.label} {change_text(d)}"


# -- the verdict ----------------------------------------------------------------------------


def _impact(r: RuleStatus) -> str:
    return r.impact.verdict if r.impact is not None else "n/a"


@dataclass
class Overall:
    verdict: str                      # fixed / improved / trade-off / regressed / no-change / workload-differs
    verdict_within_matched: str | None
    headline: str
    wins: list[str]
    costs: list[str]


def _pick(diffs: list[SignalDiff], verdict: str, prefer: list[str], limit: int = 2,
          comparable_only: bool = True) -> list[SignalDiff]:
    """The signals to name: a rule's impact signal first, then the largest changes, one per family."""
    cand = [d for d in diffs if d.verdict == verdict and (d.comparable or not comparable_only)]
    rank = {name: k for k, name in reversed(list(enumerate(prefer)))}  # earlier in prefer first
    cand.sort(key=lambda d: (rank.get(d.name, len(prefer)), -abs(d.iv.rel if d.iv and math.isfinite(d.iv.rel) else 1e9)))
    out, families = [], set()
    for d in cand:
        if d.family in families:
            continue
        families.add(d.family)
        out.append(d)
    return out[:limit]


_OBJECTIVE_STATUS = {"resolved": "met", "new": "broken", "improved": "less broken", "worse": "more broken",
                     "unchanged": "still broken"}


def rule_phrase(r: RuleStatus) -> str:
    """'prefix-cache-ineffective resolved'; an objective rule as the objective: 'TTFT objective met'."""
    if r.rule.kind == "objective":
        what = r.rule.title.split(" objective", 1)[0]
        return f"{what} objective {_OBJECTIVE_STATUS.get(r.status, r.status)}"
    return f"{r.rule.id} {r.status}"


def overall(signals: list[SignalDiff], rules: list[RuleStatus], workload: Workload) -> Overall:
    # causes first, the objectives they explain after
    rules = sorted(rules, key=lambda r: r.rule.kind == "objective")
    comparable = [d for d in signals if d.comparable]
    better = [d for d in comparable if d.verdict == "better"]
    worse = [d for d in comparable if d.verdict == "worse"]
    # a rule that stopped firing while its impact got worse (or started while it got better)
    # says more about the workload than the change: listed, not counted
    rule_wins = [r for r in rules if r.status == "improved" or (r.status == "resolved" and _impact(r) != "worse")]
    rule_costs = [r for r in rules if r.status == "worse" or (r.status == "new" and _impact(r) != "better")]
    still = [r for r in rules if r.status == "unchanged"]
    prefer = [r.rule.impact for r in rule_wins + rule_costs if r.rule.impact]
    sig_wins = [signal_phrase(d) for d in _pick(signals, "better", prefer)]
    sig_costs = [signal_phrase(d) for d in _pick(signals, "worse", prefer)]
    wins = [rule_phrase(r) for r in rule_wins] + sig_wins
    costs = [rule_phrase(r) for r in rule_costs] + sig_costs
    if (better or rule_wins) and (worse or rule_costs):
        core, text = "trade-off", "Trade-off: " + "; ".join(wins) + " better, but " + "; ".join(costs) + " worse"
    elif rule_wins:
        core = "fixed"
        text = "Fixed: " + "; ".join(wins) + ("" if better else " (no headline signal changed significantly)")
    elif better:
        core, text = "improved", "Improved: " + "; ".join(wins)
    elif worse or rule_costs:
        core, text = "regressed", "Regressed: " + "; ".join(costs)
    else:
        core, text = "no-change", "No significant change"
        if still:
            text += "; still firing: " + ", ".join(r.rule.id if r.rule.kind != "objective" else rule_phrase(r) for r in still)
    if not workload.differs:
        return Overall(core, core, text, wins, costs)
    # workloads differ: state what was measured, never as a plain win or regression
    parts = []
    if wins:
        parts.append("better: " + "; ".join(wins))
    if costs:
        parts.append("worse: " + "; ".join(costs))
    measured = " — ".join(parts) or "no significant change"
    if workload.load_differs:
        parts = [p for p in ("better: " + "; ".join(signal_phrase(d) for d in _pick(signals, "better", prefer, 3, False)),
                             "worse: " + "; ".join(signal_phrase(d) for d in _pick(signals, "worse", prefer, 3, False)))
                 if not p.endswith(": ")]
        measured = " — ".join(parts) or "no significant change"
        return Overall("workload-differs", None, f"No verdict (the load differs); as measured, {measured}", wins, costs)
    scope = "within matched prompt-length buckets" if workload.matching is not None else "on these workloads"
    return Overall("workload-differs", core, f"Not conclusive (the workloads differ); {scope}, {measured}", wins, costs)
