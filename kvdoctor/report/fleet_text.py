"""`kvdoctor diagnose --prometheus` as text: the fleet's findings, then one line per replica."""
from __future__ import annotations

from ..timeparse import iso_utc

import math

from ..fleet.diagnosis import FleetDiagnosis
from ..fleet.findings import replica_list


def render_text(fd: FleetDiagnosis) -> str:
    d = fd.data
    lines = [f"kvdoctor fleet diagnosis: {len(d.samples)} instance(s) from {d.source}",
             f"  range {_iso(d.start_s)} → {_iso(d.end_s)}, step {d.step_s:g}s"
             f"{' (auto: scrape interval ' + format(d.scrape_interval_s or 0, 'g') + 's)' if d.step_auto else ''}; {d.queries} queries, "
             f"{d.bytes / 1e6:.2f} MB fetched in {d.fetch_s:.1f}s"]
    lines += [f"  {w}" for w in d.warnings]
    lines.append("")
    if not fd.findings:
        lines.append("Fleet: no rule fired on any instance.")
    for f in fd.findings:
        lines.append(f"{f['severity'].upper()} {f['rule']} [{f['scope']}/{f['kind']}] on {replica_list(f['instances'], 10)}")
        lines.append(f"  {f['summary']}")
        for n, ev in f["evidence"].items():
            shown = ", ".join(f"{k}={v:g}" for k, v in ev.items() if v is not None)
            if shown:
                lines.append(f"  {n}: {shown}")
    lines.append("")
    lines.append("Instances:")
    for name, diag in fd.per_instance.items():
        rules = sorted({c.rule.id for i in diag.incidents for c in i.causes[:1]})
        side = sorted(e.detail["sidecar_incident"] for e in d.events.get(name, ()) if "sidecar_incident" in e.detail)
        extra = f"; sidecar reported: {', '.join(side)}" if side else ""
        lr = fd.load.get(name, math.nan)
        what = " + ".join([str(d.engines.get(name))] + sorted(d.joined.get(name, ())))
        load = f" (load {lr:,.1f} {fd.load_unit.get(name, '/s')})" if math.isfinite(lr) else ""
        lines.append(f"  {name} ({what}): {', '.join(rules) if rules else 'healthy'}{load}{extra}")
    return "\n".join(lines) + "\n"


def _iso(t: float) -> str:
    return iso_utc(t)
