"""Score fault runs: top-1 and top-3 cause accuracy, false incidents on controls, per-class recall
and precision, onset delay (fault start -> incident start, live and offline), the confusion matrix,
and whether the live verdict agrees with the offline one. Pure functions of the run records
(``runner.run_one``), so a results file re-scores without a server.

The verdict of a run: its paging incidents (warning or critical; info observations do not page)
in the order kvdoctor leads with them (``kvdoctor.diagnosis.incident.lead_key``: most severe, then
surest, then earliest: the summary's first line names the first), live incidents in that order
too; their causes in order, objective rules left out (they say an objective broke, not why). The
first is the top-1 cause; the first three, the top-3. Onset goal (issue 34): the fault named
within the ``for:`` of the rule that named it, plus 30 s (:func:`onset_in_goal`).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np

from kvdoctor.diagnosis.incident import lead_key

from .zoo import QUICK_SHARE, Cause

SEVERITY = {"critical": 2, "warning": 1}
NONE = "(no incident)"
#: an objective paged but no cause rule said why
NO_CAUSE = "(objective broken, no cause)"


def ranked_causes(incidents: list[dict] | None) -> list[tuple[str, str]]:
    """(rule, cause title) of the paging incidents' causes, the lead incident first."""
    pages = [i for i in incidents or () if not i["observation"] and i["severity"] in SEVERITY]
    pages.sort(key=lambda i: lead_key(i["severity"], max(c["confidence"] for c in i["causes"]), i["start_s"], i.get("burn_rate")))
    out: list[tuple[str, str]] = []
    for inc in pages:
        for c in inc["causes"]:
            key = (c["rule"], c["title"])
            if c["kind"] != "objective" and key not in out:
                out.append(key)
    return out


def pages(incidents: list[dict] | None) -> list[dict]:
    return [i for i in incidents or () if not i["observation"] and i["severity"] in SEVERITY]


def _expect(rec: dict) -> list[Cause]:
    return [Cause(r, s) for r, s in rec["expect"]]


def _hit(expect: list[Cause], cause: tuple[str, str]) -> bool:
    return any(e.matches(*cause) for e in expect)


def verdict_name(rec: dict, side: str = "offline") -> str:
    """The top-1 cause's rule, or what stands in for it (no incident; an objective without a cause)."""
    ranked = ranked_causes(rec.get(side))
    return ranked[0][0] if ranked else (NO_CAUSE if pages(rec.get(side)) else NONE)


def harmless(rec: dict) -> bool:
    """A fault run whose client met every objective (``client.broken`` empty: measured by the load
    generator, not by kvdoctor). The fault is there but hurt nobody: it must not page, and it is
    named right when an observation (info) names it."""
    return bool(rec["expect"]) and rec.get("client") is not None and not rec["client"]["broken"]


def judge(rec: dict, side: str = "offline") -> dict[str, Any]:
    """One run's outcome on one side (``offline`` or ``live``)."""
    incidents = rec.get(side)
    expect = _expect(rec)
    ranked = ranked_causes(incidents)
    paged = bool(pages(incidents))
    verdict = ranked[0] if ranked else None
    if not expect:  # nothing at the server is at fault: right when nothing pages
        return {"top1": not paged, "top3": not paged, "paged": paged, "verdict": verdict}
    if harmless(rec):
        observed = any(_hit(expect, (c["rule"], c["title"])) for i in incidents or () if i not in pages(incidents)
                       for c in i["causes"])
        return {"top1": not paged and observed, "top3": not paged and observed, "paged": paged, "verdict": verdict,
                "observed": observed}
    return {"top1": bool(ranked) and _hit(expect, ranked[0]), "top3": any(_hit(expect, c) for c in ranked[:3]),
            "paged": paged, "verdict": verdict}


def onset_s(rec: dict, side: str = "offline") -> float | None:
    """Seconds from the fault's start to the first paging incident that names it (offline: the
    incident's start; live: when the sidecar announced it)."""
    got = onset(rec, side)
    return got[0] if got else None


def onset(rec: dict, side: str = "offline") -> tuple[float, str] | None:
    """(:func:`onset_s`, the rule whose cause named the fault first there); None where none did."""
    expect = _expect(rec)
    if not expect or "fault_start_s" not in rec:
        return None
    if side == "live":
        if rec.get("live_first_s") is not None:  # polled: when a paging live incident first named it
            times = [(t, rule) for rule, title, paging, t in rec["live_first_s"] if paging and _hit(expect, (rule, title))]
        else:  # announced: incidents that named it when they opened
            times = [(o["t"], c["rule"]) for o in rec.get("opened") or ()
                     if not o["observation"] and o["severity"] in SEVERITY
                     for c in o["causes"] if _hit(expect, (c["rule"], c["title"]))]
    else:
        times = [(i["start_s"], c["rule"]) for i in pages(rec.get("offline"))
                 for c in i["causes"] if _hit(expect, (c["rule"], c["title"]))]
    if not times:
        return None
    t, rule = min(times)
    return round(max(0.0, t - rec["fault_start_s"]), 1), rule


#: the onset goal (issue 34): within the naming rule's ``for:`` hold plus this
ONSET_SLACK_S = 30.0


def _holds() -> dict[str, float]:
    from kvdoctor.diagnosis.rules import load_rules

    return {r.id: r.for_s for r in load_rules()}


def onset_in_goal(rec: dict, side: str, holds: dict[str, float]) -> bool | None:
    """Whether the fault was named within its naming rule's ``for:`` + 30 s (None: never named)."""
    got = onset(rec, side)
    return None if got is None else got[0] <= holds.get(got[1], 0.0) + ONSET_SLACK_S


def predicted_class(rec: dict, classes: dict[str, list[Cause]], side: str = "offline") -> str:
    """The class the verdict names: the first class whose expected causes hold the top-1 cause;
    the rule itself where no class expects it; "(no incident)" where nothing paged."""
    ranked = ranked_causes(rec.get(side))
    if not ranked:
        return NO_CAUSE if pages(rec.get(side)) else NONE
    for cls, expect in classes.items():
        if expect and _hit(expect, ranked[0]):
            return cls
    return ranked[0][0]


def _valid(rec: dict) -> bool:
    return rec.get("injected", True) and "error" not in rec


def score(records: list[dict]) -> dict[str, Any]:
    valid = [r for r in records if _valid(r)]
    classes: dict[str, list[Cause]] = {}
    for r in valid:
        classes.setdefault(r["class"], _expect(r) if r["class"] != "control" else [])
    faults = [r for r in valid if r["expect"] and not harmless(r)]
    quiet_faults = [r for r in valid if harmless(r)]
    controls = [r for r in valid if r["class"] == "control"]

    def rate(xs: list[bool]) -> float | None:
        return round(float(np.mean(xs)), 3) if xs else None

    holds = _holds()

    def onsets(rs: list[dict], side: str) -> dict:
        v = [o for o in (onset_s(r, side) for r in rs) if o is not None]
        ok = [g for g in (onset_in_goal(r, side, holds) for r in rs) if g is not None]
        return {"n": len(v), "median_s": round(float(np.median(v)), 1) if v else None,
                "max_s": round(float(np.max(v)), 1) if v else None, "in_goal": rate(ok)}

    per_class: dict[str, dict] = {}
    predicted = [(r["class"], predicted_class(r, classes)) for r in valid]
    for cls in classes:
        rs = [r for r in valid if r["class"] == cls]
        js = [judge(r) for r in rs]
        # precision: of the runs whose verdict named this class, how many were this class (the
        # no-fault classes' "verdict" is silence, shared by all of them: precision is n/a)
        named = [actual for actual, pred in predicted if pred == cls] if classes[cls] else []
        per_class[cls] = {
            "runs": len(rs), "engines": sorted({r["engine"] for r in rs}),
            "settings": len({r["setting"] for r in rs}),
            "recall": rate([j["top1"] for j in js]), "top3": rate([j["top3"] for j in js]),
            "precision": round(sum(a == cls for a in named) / len(named), 3) if named else None,
            "onset_offline": onsets(rs, "offline"), "onset_live": onsets(rs, "live"),
            "by_engine": {e: rate([judge(r)["top1"] for r in rs if r["engine"] == e])
                          for e in sorted({r["engine"] for r in rs})},
        }
    live = [r for r in valid if r.get("live") is not None]
    disagree = []
    for r in live:
        a, b = verdict_name(r, "offline"), verdict_name(r, "live")
        if a != b:
            disagree.append({"run": f"{r['class']}/{r['setting']} on {r['engine']}", "offline": a, "live": b})
    confusion: dict[str, Counter] = defaultdict(Counter)
    for actual, pred in predicted:
        confusion[actual][pred] += 1
    return {
        "runs": len(records), "valid_runs": len(valid),
        "invalid": [f"{r['class']}/{r['setting']} on {r['engine']}: "
                    f"{r.get('error') or 'the fault did not take effect'}" for r in records if not _valid(r)],
        "fault_runs": len(faults), "control_runs": len(controls),
        "harmless_fault_runs": len(quiet_faults),
        "harmless_paged": rate([judge(r)["paged"] for r in quiet_faults]),
        "harmless_observed": rate([judge(r)["observed"] for r in quiet_faults]),
        "top1": rate([judge(r)["top1"] for r in faults]),
        "top3": rate([judge(r)["top3"] for r in faults]),
        "false_incident_rate": rate([judge(r)["paged"] for r in controls]),
        "live_top1": rate([judge(r, "live")["top1"] for r in faults if r.get("live") is not None]),
        "onset_offline": onsets(faults, "offline"), "onset_live": onsets(faults, "live"),
        "live_offline_agreement": round(1 - len(disagree) / len(live), 3) if live else None,
        "disagreements": disagree,
        "per_class": per_class,
        "confusion": {a: dict(c) for a, c in sorted(confusion.items())},
    }


# --------------------------------------------------------------------------- the doc

def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:g} s"


PUBLISHED = """\
## Against published figures

| system | setup | measure | figure |
|---|---|---|---|
| best of 24 root-cause methods ("Beyond Microservices", arXiv 2603.02057) | Kubernetes + Ray + vLLM, injected infrastructure faults, learned and statistical RCA over metrics, traces, logs | top-1 root cause | 0.77 |
| LatencyPrism (arXiv 2601.09258) | learned per-deployment latency model | load vs anomaly, F1 | 0.98 (names no cause) |
| vLLM Doctor, hotpath | vLLM only | accuracy | none published |
| **kvdoctor (this benchmark)** | real llama.cpp and vLLM (CPU, SmolLM2-135M), serving faults injected by construction, no training | top-1 cause | see above |

The setups differ: the RCA study injects infrastructure faults (pod, node, network) into a
distributed stack and asks which component failed; this benchmark injects serving faults
(load, cache, prompt mix, engine and gateway behaviour) into one engine and asks which serving
mechanism is at fault and which knob fixes it. Neither number transfers to the other setup.
"""


def render(results: dict[str, Any]) -> str:
    """docs/accuracy.md from a results file (``benchmarks/faults/run.py --write-docs``)."""
    s, meta = results["score"], results["meta"]
    lines = [
        "# Measured accuracy: the fault benchmark",
        "",
        "<!-- generated by benchmarks/faults/run.py --write-docs from benchmarks/faults/results.json; "
        "tests/test_faults.py checks it is current -->",
        "",
        "Every run injects one known fault into a real server (llama.cpp `llama-server` or vLLM "
        f"{meta.get('vllm_version', '')} on CPU, SmolLM2-135M) with kvdoctor attached, so the label is the fault's "
        "construction, never kvdoctor's output. Controls inject nothing and must page nobody. "
        "The fault classes, their settings and what names each are in `benchmarks/faults/zoo.py`; "
        "the scoring in `benchmarks/faults/score.py`. Rerun with `python benchmarks/faults/run.py` "
        "(all settings, ~{:.0f} min here) or `--quick` (one setting per class at {:.0%} of its requests: a check "
        "that the benchmark runs and scores; its scores are not these figures).".format(meta["wall_s"] / 60, QUICK_SHARE),
        "",
        f"Run: `{meta['command']}` on {meta['machine']}, {meta['date']} (kvdoctor {meta['kvdoctor']}).",
        "",
        "## Summary",
        "",
        "| measure | figure | goal |",
        "|---|---|---|",
        f"| top-1 cause right (fault runs that hurt: the client saw an objective broken) | {_pct(s['top1'])} of {s['fault_runs']} | >= 90% |",
        f"| cause in top 3 | {_pct(s['top3'])} | |",
        f"| false incidents on controls | {_pct(s['false_incident_rate'])} of {s['control_runs']} | <= 5% |",
        f"| faults that hurt nobody: paged anyway | {_pct(s['harmless_paged'])} of {s['harmless_fault_runs']} | 0% |",
        f"| faults that hurt nobody: named as an observation | {_pct(s['harmless_observed'])} | |",
        f"| top-1 right, live verdict | {_pct(s['live_top1'])} | |",
        f"| live verdict = offline verdict | {_pct(s['live_offline_agreement'])} | 100% |",
        f"| onset, offline (median / max) | {_s(s['onset_offline']['median_s'])} / {_s(s['onset_offline']['max_s'])} | |",
        f"| onset, live (median / max) | {_s(s['onset_live']['median_s'])} / {_s(s['onset_live']['max_s'])} | |",
        f"| named within the naming rule's `for:` + 30 s, offline / live (of {s['onset_offline']['n']} / "
        f"{s['onset_live']['n']} named) | {_pct(s['onset_offline'].get('in_goal'))} / "
        f"{_pct(s['onset_live'].get('in_goal'))} | 100% |",
        "",
        "A fault run *hurts* when the load generator's own timings break one of the run's objectives (the chat "
        "defaults, TTFT P99 2 s, TPOT P99 100 ms, errors 1%; a CPU deployment of vLLM in float32 states TPOT P99 "
        "250 ms): ground truth measured beside kvdoctor, not by it. kvdoctor pages on harm, so a fault that hurt "
        "nobody is right when nothing pages and an observation names it; those runs are counted apart.",
        "",
    ]
    if s["invalid"]:
        lines += ["Runs left out of the score (the fault did not take effect, or the run failed):", ""]
        lines += [f"- {x}" for x in s["invalid"]] + [""]
    lines += ["## Per class", "",
              "Recall: runs of the class whose top-1 cause names it (for the no-fault classes: runs that paged "
              "nobody). Precision: runs whose top-1 cause named the class that were of it.", "",
              "| class | runs | settings | engines | recall | top 3 | precision | llama.cpp | vLLM | onset offline (median) | onset live (median) | live onset in goal |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cls, c in s["per_class"].items():
        lines.append(f"| {cls} | {c['runs']} | {c['settings']} | {', '.join(c['engines'])} | {_pct(c['recall'])} | "
                     f"{_pct(c['top3'])} | {_pct(c['precision'])} | {_pct(c['by_engine'].get('llamacpp'))} | "
                     f"{_pct(c['by_engine'].get('vllm'))} | {_s(c['onset_offline']['median_s'])} | "
                     f"{_s(c['onset_live']['median_s'])} | {_pct(c['onset_live'].get('in_goal'))} |")
    preds = sorted({p for row in s["confusion"].values() for p in row})
    lines += ["", "## Confusion matrix", "", "Rows: the injected fault; columns: the class the top-1 cause names "
              "(a rule name where no class expects that rule).", "",
              "| injected \\ named | " + " | ".join(preds) + " |", "|---" * (len(preds) + 1) + "|"]
    for actual, row in s["confusion"].items():
        lines.append(f"| {actual} | " + " | ".join(str(row.get(p, "")) for p in preds) + " |")
    lines += ["", "## Runs", "", "| class / setting | engine | injected | client: objectives broken | top-1 cause (offline) | live | right |",
              "|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        j, jl = judge(r), (judge(r, "live") if r.get("live") is not None else None)
        v = j["verdict"]
        lv = "n/a" if jl is None else verdict_name(r, "live")
        ok = "left out" if not _valid(r) else ("yes" if j["top1"] else "no")
        broken = ", ".join((r.get("client") or {}).get("broken") or ()) or "none"
        if j.get("observed") is not None:
            ok += " (hurt nobody; " + ("named as an observation)" if j["observed"] else "not named)")
        lines.append(f"| {r['class']} / {r['setting']} | {r['engine']} | {r['what']} | {broken} | "
                     f"{v[0] + ': ' + v[1] if v else verdict_name(r)} | {lv} | {ok} |")
    if s["disagreements"]:
        lines += ["", "## Live and offline disagree", ""]
        lines += [f"- {d['run']}: offline {d['offline']}, live {d['live']}" for d in s["disagreements"]]
    notes = results.get("notes")
    if notes:
        lines += ["", "## Why the weak classes miss", "", notes.strip()]
    lines += ["", PUBLISHED]
    return "\n".join(lines).rstrip() + "\n"
