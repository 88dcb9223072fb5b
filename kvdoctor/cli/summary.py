"""`kvdoctor summary`: the short on-call text."""
from __future__ import annotations

import click

from .diagnose import diagnosis_options, run_diagnosis


@click.command("summary")
@diagnosis_options
@click.option("-v", "--verbose", is_flag=True, help="List every rule not evaluated and name each signal's identifier.")
def command(capture, since, until, rules_dirs, slo, sets, lookback, step, max_model_len, verbose):
    """The on-call text: what happened, when, impact, likely cause with evidence, first fix.

    At most ~15 lines per incident, most severe first, readable on a phone.

    \b
    Examples:
      kvdoctor summary samples/multi-turn
      kvdoctor summary cap/ --slo ttft_p99=2s | mail -s "TTFT incident" oncall@example.com
    """
    from ..report.summary import summary_text

    from .common import printable

    click.echo(printable(summary_text(run_diagnosis(capture, since, until, rules_dirs, slo, sets, lookback, step,
                                                    max_model_len), verbose=verbose)), nl=False)
