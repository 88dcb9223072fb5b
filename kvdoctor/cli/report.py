"""`kvdoctor report`: the interactive HTML report."""
from __future__ import annotations

import click

from ..errors import InputError
from . import params as P
from .common import finish, load_rules_checked
from .diagnose import diagnosis_args, diagnosis_options, run_diagnosis
from .fleet_options import check_fleet_only, fleet_diagnosis, fleet_finish, fleet_options


@click.command("report")
@diagnosis_options(capture_required=False)  # fleet mode (--prometheus) stands in for CAPTURE
@click.argument("after", required=False, type=click.Path())
@click.option("-o", "--output", type=P.OutputFile(), default="report.html", show_default=True,
              help="HTML file to write (its folder must exist).")
@click.option("--title", help="Page title (default: kvdoctor report · CAPTURE).")
@fleet_options  # --- fleet mode (kvdoctor/cli/fleet_options.py) ---
def command(capture, after, output, title, fail_on, **kw):
    """One self-contained HTML file: the incidents, their evidence and fixes, and the charts
    that support them. Works offline (plotly.js is embedded); open it in any browser.

    \b
    Examples:
      kvdoctor report samples/aibrix-qps-4.1 -o report.html
      kvdoctor report cap/ --slo ttft_p99=2s --slo tpot_p99=80ms --title "prod-a, Nov 30"
      kvdoctor report before/ after/ -o fix.html     # two captures: before/after page (kvdoctor compare)
      kvdoctor report --prometheus http://prom:9090 --selector '{job="vllm"}' --since 2h -o fleet.html

    SLO lines on the charts use --slo, else the report defaults (TTFT P99 2 s, TPOT P99 100 ms,
    ITL P99 200 ms, error rate 1%). With two captures, --fail-on looks at AFTER's incidents.
    """
    from pathlib import Path

    if kw.get("prometheus"):
        if capture or after:
            raise InputError("give either CAPTURE or --prometheus, not both")
        from ..report.fleet_html import render_fleet_html

        args = diagnosis_args(kw)
        if args.pop("max_model_len"):
            raise InputError("--max-model-len applies to a capture; fleet mode reads the engines' own limits")
        fd = fleet_diagnosis(kw.pop("prometheus"), kw.pop("selector"), **args, **kw)
        path = Path(output)
        _write(path, render_fleet_html(fd, title))
        flagged = len({n for f in fd.findings for n in f["instances"]})
        click.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); {len(fd.per_instance)} replicas, {flagged} flagged")
        fleet_finish(fd, fail_on)
        return
    check_fleet_only(kw)
    if not capture:
        raise InputError("missing CAPTURE (or --prometheus URL for a fleet page)")
    if after:
        from ..compare.api import compare
        from ..diagnosis import Options
        from ..report.compare_html import render_compare_html

        args = diagnosis_args(kw)
        if args["since"] is not None or args["until"] is not None:
            raise InputError("--since/--until cut one capture; for two, give each as CAPTURE@T1..T2")
        rules = load_rules_checked(args["rules_dirs"], args["sets"])
        comp = compare(capture, after, rules, Options(lookback_s=args["lookback"], step_s=args["step"],
                                                      max_model_len_tokens=args["max_model_len"], **args["objectives"]))
        path = Path(output)
        _write(path, render_compare_html(comp.before_diag, comp.after_diag, comp, title))
        click.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); {comp.lines[0]}")
        finish([comp.after_diag], fail_on)
        return
    from ..report.html import render_report

    diag = run_diagnosis(capture, **diagnosis_args(kw))
    path = render_report(diag, output, title=title)
    n = len(diag.incidents)
    click.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB; {n} incident{'s' if n != 1 else ''})")
    finish([diag], fail_on)


def _write(path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise InputError(f"-o {path}: cannot write ({e.strerror or e})") from None
