"""`kvdoctor oncall`: receive Alertmanager webhooks, diagnose each alert's instance through Prometheus."""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import InputError
from . import params as P
from .common import objective_options, pop_objectives


@click.command("oncall")
@click.option("--prometheus", required=True, type=P.URL, help="Prometheus the alerts come from (diagnoses read it).")
@click.option("--listen", default="127.0.0.1:9095", show_default=True, type=P.Address(9095),
              help="Where Alertmanager posts (POST /alertmanager); also /incidents, /report/ID, /healthz.")
@click.option("--forward-webhook", "forward", multiple=True, type=P.URL,
              help="Slack-compatible incoming webhook to post each summary to as {\"text\": ...} (repeatable).")
@click.option("--token", envvar="KVDOCTOR_TOKEN", help="Require 'Authorization: Bearer TOKEN' (env KVDOCTOR_TOKEN; /healthz "
              "stays open). Prefer --token-file: an argument is visible to every local user in ps.")
@click.option("--token-file", type=click.Path(dir_okay=False), help="Read --token from this file (first line).")
@click.option("--public-url", type=P.URL, help="Base URL the report links use (default http://LISTEN).")
@click.option("--bearer-token", envvar="KVDOCTOR_PROM_TOKEN", help="Bearer token for Prometheus (or $KVDOCTOR_PROM_TOKEN).")
@click.option("--bearer-token-file", type=click.Path(dir_okay=False), help="Read --bearer-token from this file (first line).")
@click.option("--prom-timeout", type=P.Duration(max_s=3600), default=P.PROM_TIMEOUT, show_default=True,
              help="Timeout per Prometheus query.")
@click.option("--group-by", type=P.Labels(), default="instance", show_default=True,
              help="The alert label that names the instance.")
@click.option("--lookback", type=P.Duration(min_s=1), default="5m", show_default=True,
              help="Window each evaluation looks back over.")
@click.option("--before", type=P.Duration(zero_ok=True), default="15m", show_default=True,
              help="How far before the alert's start the diagnosis begins.")
@click.option("--step", type=P.Duration(min_s=1), help="Time between evaluations (default: the window / 300, at least 2s).")
@click.option("--queue", "queue_max", default=32, show_default=True, type=P.Count(1, 100_000),
              help="Most instances waiting for a diagnosis.")
@click.option("--workers", default=1, show_default=True, type=P.Count(1, 64), help="Diagnoses run at the same time.")
@click.option("--rules", "rules_dirs", multiple=True, type=P.InputFile(dir_okay=True, file_okay=False),
              help="Extra folder of rule files (repeatable).")
@objective_options
@click.option("-q", "--quiet", is_flag=True, help="Do not print the summaries.")
def command(prometheus, listen, forward, token, token_file, public_url, bearer_token, bearer_token_file, prom_timeout,
            group_by, lookback, before, step, queue_max, workers, rules_dirs, quiet, **objectives):
    """Turn Alertmanager pages into diagnosed on-call summaries (docs/oncall.md).

    For each new firing alert, diagnoses the alert's instance over the alert's window through
    Prometheus (as `kvdoctor diagnose --prometheus` does for a fleet) and posts what, since when,
    the impact, the top cause with evidence, the first fix and a link to the HTML report.

    \b
    Example (Alertmanager: webhook_configs: [{url: http://127.0.0.1:9095/alertmanager}]):
      kvdoctor oncall --prometheus http://prom:9090 --forward-webhook https://hooks.slack.com/services/…
    """
    import asyncio
    import logging
    import signal

    from aiohttp import web

    from ..sidecar.agent import host_port
    from ..diagnosis import load_rules
    from ..oncall.diagnose import Setup
    from ..oncall.service import OnCall, make_app
    from .attach import port_free, read_token

    token = read_token(token, token_file) if (token or token_file) else None
    bearer_token = read_token(bearer_token, bearer_token_file, "--bearer-token") if (bearer_token or bearer_token_file) else None
    host, port = host_port(listen, 9095, "--listen")
    why = port_free(host, port)
    if why:
        raise InputError(f"--listen {listen}: cannot listen there ({why}); choose another HOST:PORT")
    setup = Setup(prometheus, load_rules([Path(d) for d in rules_dirs]), lookback_s=lookback, before_s=before, step_s=step,
                  bearer_token=bearer_token, timeout_s=prom_timeout, group_by=group_by, **pop_objectives(objectives))
    logging.basicConfig(level=logging.ERROR if quiet else logging.WARNING, format="%(message)s")

    async def main() -> None:
        oncall = OnCall(setup, tuple(forward), public_url or f"http://{host}:{port}", queue_max, workers)
        await oncall.start()
        runner = web.AppRunner(make_app(oncall, token), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        click.echo(f"kvdoctor oncall listening on http://{host}:{port}/alertmanager", err=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await oncall.stop()
        await runner.cleanup()

    asyncio.run(main())
