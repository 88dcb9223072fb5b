"""`kvdoctor rules export --format prometheus`: alerting rules from the rule files (kvdoctor/alerts/)."""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import InputError
from . import params as P


@click.command("export")
@click.option("--format", "fmt", type=click.Choice(["prometheus"]), required=True,
              help="prometheus: Prometheus alerting rule files.")
@click.option("-o", "--output", type=P.OutputFolder(),
              help="Write one file per engine (and the sidecar's) into this folder; default: one file to standard output.")
@click.option("--rules", "rules_dirs", multiple=True, type=P.InputFile(dir_okay=True, file_okay=False),
              help="Extra folder of rule files (repeatable).")
@click.option("--window", type=P.PromDuration(min_s=1, max_s=30 * 86400), default="5m", show_default=True,
              help="Window every signal is computed over (the rules' lookback).")
@click.option("--slo", multiple=True, type=P.OBJECTIVE,
              help="Objectives the SLO alerts and rules use (default ttft_p99=2s, tpot_p99=100ms, error_rate=1%).")
@click.option("--min-for", type=P.Duration(zero_ok=True, max_s=7 * 86400), default="2m", show_default=True,
              help="Shortest for: any alert gets (a rule's own for: when longer).")
@click.option("--for", "for_all", type=P.Duration(zero_ok=True, max_s=7 * 86400),
              help="Every alert's for: (e.g. a short hold in a test setup).")
@click.option("--runbook-base", type=P.URL, help="URL of docs/runbooks.md that runbook_url anchors point into.")
@click.option("--runbooks", "runbooks_path", type=P.OutputFile(), help="Also write the runbook page here.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if the files in --output (and --runbooks) differ.")
def export_command(fmt, output, rules_dirs, window, slo, min_for, for_all, runbook_base, runbooks_path, check):
    """Prometheus alerting rules generated from the rules where their signals map to engine
    metrics; says on standard error which rules cannot be expressed in PromQL and why.

    \b
    Examples:
      kvdoctor rules export --format prometheus -o alerts/ --runbooks docs/runbooks.md
      kvdoctor rules export --format prometheus --slo ttft_p99=1s --window 10m > kvdoctor-alerts.yaml
      kvdoctor rules export --format prometheus -o alerts/ --check     # CI: shipped files up to date

    """

    from ..alerts import export as E
    from ..alerts.runbooks import markdown
    from ..diagnosis import load_rules
    from ..objectives import parse_slo

    opts = E.Options(window=window, slo={**E.DEFAULT_SLO, **parse_slo(slo)}, min_for_s=min_for,
                     for_s=for_all, runbook_base=runbook_base or E.RUNBOOK_BASE)
    rules = load_rules([Path(d) for d in rules_dirs])
    ex = E.export(rules, opts)
    texts = E.files_text(ex)
    wanted = {Path(output) / n: t for n, t in texts.items()} if output else {}
    if runbooks_path:
        wanted[Path(runbooks_path)] = markdown(rules)
    if check:
        if not wanted:
            raise InputError("--check needs --output (and/or --runbooks) to compare against")
        stale = [str(p) for p, t in wanted.items() if not p.exists() or p.read_text() != t]
        for p in stale:
            click.echo(f"out of date: {p} (re-run without --check)", err=True)
        raise SystemExit(1 if stale else 0)
    click.echo(E.skipped_text(ex), err=True, nl=False)
    if not output:
        groups = [g for doc in ex.files.values() for g in doc["groups"]]
        click.echo(E.render({"groups": groups}, E.header("all", ex)), nl=False)
    for p, t in wanted.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(t)
    if wanted:
        click.echo(f"wrote {len(wanted)} files: {', '.join(str(p) for p in wanted)}", err=True)
