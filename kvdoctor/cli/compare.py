"""`kvdoctor compare`: did the fix work, and what did it cost?"""
from __future__ import annotations

from pathlib import Path

import click
import orjson

from ..errors import InputError
from . import params as P
from .common import (fail_on_option, finish, format_option, load_rules_checked, objective_options, output_option,
                     pop_objectives, rules_option, set_option, write_out)


@click.command("compare")
@click.argument("before")
@click.argument("after")
@format_option()
@output_option
@click.option("--html", "html_path", type=P.OutputFile(),
              help="Also write a self-contained HTML page with before/after charts.")
@rules_option
@objective_options
@set_option
@click.option("--lookback", type=P.Duration(min_s=0.001), default="5m", show_default=True,
              help="Window each rule evaluation looks back over.")
@click.option("--step", type=P.Duration(min_s=0.001), default="1m", show_default=True, help="Time between rule evaluations.")
@click.option("--resamples", default=2000, show_default=True, type=click.IntRange(1000, 100_000),
              help="Bootstrap resamples per interval.")
@click.option("--seed", default=20240607, show_default=True, type=click.IntRange(0, 2**32 - 1),
              help="Bootstrap seed (same seed, same intervals).")
@fail_on_option
def command(before, after, fmt, output, html_path, rules_dirs, sets, lookback, step, resamples, seed, fail_on, **kw):
    """Compare BEFORE with AFTER: what became of each finding, and how the headline signals
    moved, each change with a 95% confidence interval.

    BEFORE and AFTER are capture folders, or a time range of one: CAPTURE@T1..T2, where T is
    epoch seconds, ISO 8601 (2026-11-30T08:00:00Z) or +SECONDS from the capture's start;
    either bound may be left out (cap@+600..). Prometheus ranges are not supported (there is
    no fleet mode): import or capture each side first.

    Rules: resolved / improved / unchanged / worse / new (improved and worse judged on the
    rule's impact signal and its interval). Signals: TTFT, TPOT, ITL, E2E at P50/P90/P99,
    per-turn TPOT growth, prefix hit rate, KV usage peak, error rate, throughput; a signal is
    better or worse only when it moved >= 5% and the change is significant after Holm's
    correction over all signals tested (family-wise error 5%; the intervals shown are 95%).
    When the workloads differ (arrival rate, prompt/output lengths, turn mix, concurrency)
    the first line says so and latency is compared within matched prompt-length buckets.
    A change that helps one signal and hurts another is reported as a trade-off.

    \b
    Examples:
      kvdoctor compare before/ after/
      kvdoctor compare cap/@+0..+600 cap/@+900..+1500      # one capture, before and after a restart
      kvdoctor compare off/ on/ --format json | jq '.verdict, .signals[0]'
      kvdoctor compare off/ on/ --html compare.html --slo ttft_p99=2s
      kvdoctor compare before/ after/ --fail-on warning     # CI: exit 7 while AFTER still has an incident

    The exit status does not follow the verdict; --fail-on judges AFTER's incidents.
    """
    from ..compare import compare
    from ..compare.render import markdown, text, to_json
    from ..diagnosis import Options
    from ..compare.sides import load_side, parse_side

    b_spec, a_spec = parse_side(before, "BEFORE"), parse_side(after, "AFTER")  # syntax errors before any loading
    opts = Options(lookback_s=lookback, step_s=step, workers=0, **pop_objectives(kw))
    rules = load_rules_checked(rules_dirs, sets)
    comp = compare(load_side(b_spec, "BEFORE"), load_side(a_spec, "AFTER"), rules, opts, resamples, seed)
    if fmt == "json":
        out = orjson.dumps(to_json(comp), option=orjson.OPT_INDENT_2).decode() + "\n"
    elif fmt == "markdown":
        out = markdown(comp)
    else:
        out = text(comp)
    write_out(out, output)
    if html_path:
        from ..report.compare_html import render_compare_html

        path = Path(html_path)
        try:
            path.write_text(render_compare_html(comp.before_diag, comp.after_diag, comp), encoding="utf-8")
        except OSError as e:
            raise InputError(f"--html {path}: cannot write ({e.strerror or e})") from None
        click.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", err=True)
    finish([comp.after_diag], fail_on)
