"""`kvdoctor summary`: the short on-call text."""
from __future__ import annotations

import click
import orjson

from .common import finish, format_option, output_option, write_out
from .diagnose import diagnosis_args, diagnosis_options, run_diagnosis


@click.command("summary")
@diagnosis_options
@format_option()
@output_option
@click.option("-v", "--verbose", is_flag=True, help="List every rule not evaluated and name each signal's identifier.")
def command(capture, fmt, output, fail_on, verbose, **kw):
    """The on-call text: the verdict in three lines (what and since when, with the likely cause;
    the first fix for the recorded engine; where, against which objectives), the key numbers, then
    each incident and the observations.

    At most ~15 lines per incident, most severe first, readable on a phone. --format json
    prints the same JSON as `kvdoctor diagnose --format json`.

    \b
    Examples:
      kvdoctor summary samples/prefix-cache-off
      kvdoctor summary cap/ --slo ttft_p99=2s | mail -s "TTFT incident" oncall@example.com
      kvdoctor summary cap/ --since 2h --format markdown -o incident.md
    """
    from ..report.summary import markdown, summary_text

    diag = run_diagnosis(capture, **diagnosis_args(kw))
    if fmt == "json":
        text = orjson.dumps(diag.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n"
    elif fmt == "markdown":
        text = markdown(diag)
    else:
        text = summary_text(diag, verbose=verbose)
    write_out(text, output)
    finish([diag], fail_on)
