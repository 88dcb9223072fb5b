"""`kvdoctor report`: the interactive HTML report."""
from __future__ import annotations

import click

from ..errors import InputError
from .diagnose import diagnosis_options, run_diagnosis
from .fleet_options import fleet_diagnosis, fleet_options


@click.command("report")
@diagnosis_options(capture_required=False)  # fleet mode (--prometheus) stands in for CAPTURE
@click.argument("after", required=False, type=click.Path())
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="report.html", show_default=True,
              help="HTML file to write.")
@click.option("--title", help="Page title (default: kvdoctor report · CAPTURE).")
@fleet_options  # --- fleet mode (kvdoctor/cli/fleet_options.py) ---
def command(capture, after, since, until, rules_dirs, slo, sets, lookback, step, max_model_len, output, title, **fleet):
    """One self-contained HTML file: the incidents, their evidence and fixes, and the charts
    that support them. Works offline (plotly.js is embedded); open it in any browser.

    \b
    Examples:
      kvdoctor report samples/aibrix-qps-4.1 -o report.html
      kvdoctor report cap/ --slo ttft_p99=2s --slo tpot_p99=80ms --title "prod-a, Nov 30"
      kvdoctor report before/ after/ -o fix.html     # two captures: before/after page (kvdoctor compare)
      kvdoctor report --prometheus http://prom:9090 --selector '{job="vllm"}' --since 2h -o fleet.html

    SLO lines on the charts use --slo, else the report defaults (TTFT P99 2 s, TPOT P99 100 ms,
    ITL P99 200 ms, error rate 1%). Exit status: 0 done, 2 bad input, 3 bad rule file, 4 nothing
    could be read from --prometheus.
    """
    from pathlib import Path

    if fleet.get("prometheus"):
        if capture or after:
            raise InputError("give either CAPTURE or --prometheus, not both")
        from ..report.fleet_html import render_fleet_html

        fd = fleet_diagnosis(fleet.pop("prometheus"), fleet.pop("selector"), since, until, step=step, lookback=lookback,
                             rules_dirs=rules_dirs, slo=slo, sets=sets, **fleet)
        path = Path(output)
        path.write_text(render_fleet_html(fd, title), encoding="utf-8")
        flagged = len({n for f in fd.findings for n in f["instances"]})
        click.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); {len(fd.per_instance)} replicas, {flagged} flagged")
        return
    if not capture:
        raise InputError("missing CAPTURE (or --prometheus URL for a fleet page)")
    if after:
        from ..compare.api import compare
        from ..diagnosis import Options, load_rules, parse_slo
        from ..diagnosis.rules import parse_duration, parse_overrides
        from ..report.compare_html import render_compare_html

        comp = compare(capture, after, load_rules([Path(d) for d in rules_dirs], parse_overrides(sets)),
                       Options(lookback_s=parse_duration(lookback), step_s=parse_duration(step), slo=parse_slo(slo)))
        path = Path(output)
        path.write_text(render_compare_html(comp.before_diag, comp.after_diag, comp, title), encoding="utf-8")
        click.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); {comp.lines[0]}")
        return
    from ..report.html import render_report

    diag = run_diagnosis(capture, since, until, rules_dirs, slo, sets, lookback, step, max_model_len)
    path = render_report(diag, output, title=title)
    n = len(diag.incidents)
    click.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB; {n} incident{'s' if n != 1 else ''})")
