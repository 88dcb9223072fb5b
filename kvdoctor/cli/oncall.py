"""`kvdoctor oncall`: receive Alertmanager webhooks, diagnose each alert's instance through Prometheus."""
from __future__ import annotations

from pathlib import Path

import click

from ..errors import InputError


@click.command("oncall")
@click.option("--prometheus", required=True, metavar="URL", help="Prometheus the alerts come from (diagnoses read it).")
@click.option("--listen", default="127.0.0.1:9095", show_default=True, metavar="HOST:PORT",
              help="Where Alertmanager posts (POST /alertmanager); also /incidents, /report/ID, /healthz.")
@click.option("--forward-webhook", "forward", multiple=True, metavar="URL",
              help="Slack-compatible incoming webhook to post each summary to as {\"text\": ...} (repeatable).")
@click.option("--token", envvar="KVDOCTOR_TOKEN", help="Require 'Authorization: Bearer TOKEN' (env KVDOCTOR_TOKEN; /healthz stays open).")
@click.option("--public-url", help="Base URL the report links use (default http://LISTEN).")
@click.option("--bearer-token", envvar="KVDOCTOR_PROM_TOKEN", help="Bearer token for Prometheus (or $KVDOCTOR_PROM_TOKEN).")
@click.option("--prom-timeout", default="30s", show_default=True, help="Timeout per Prometheus query.")
@click.option("--group-by", default="instance", show_default=True, help="The alert label that names the instance.")
@click.option("--lookback", default="5m", show_default=True, help="Window each evaluation looks back over.")
@click.option("--before", default="15m", show_default=True, help="How far before the alert's start the diagnosis begins.")
@click.option("--step", help="Time between evaluations (default: the window / 300, at least 2s).")
@click.option("--queue", "queue_max", default=32, show_default=True, help="Most instances waiting for a diagnosis.")
@click.option("--workers", default=1, show_default=True, help="Diagnoses run at the same time.")
@click.option("--rules", "rules_dirs", multiple=True, type=click.Path(), help="Extra folder of rule files (repeatable).")
@click.option("--slo", multiple=True, metavar="NAME=VALUE", help="Objectives, e.g. --slo ttft_p99=2s.")
@click.option("-q", "--quiet", is_flag=True, help="Do not print the summaries.")
def command(prometheus, listen, forward, token, public_url, bearer_token, prom_timeout, group_by, lookback, before, step,
            queue_max, workers, rules_dirs, slo, quiet):
    """Turn Alertmanager pages into diagnosed on-call summaries (docs/oncall.md).

    For each new firing alert, diagnoses the alert's instance over the alert's window through
    Prometheus (as `kvdoctor diagnose --prometheus` does for a fleet) and posts what, since when,
    the impact, the top cause with evidence, the first fix and a link to the HTML report.

    \b
    Example (Alertmanager: webhook_configs: [{url: http://127.0.0.1:9095/alertmanager}]):
      kvdoctor oncall --prometheus http://prom:9090 --forward-webhook https://hooks.slack.com/services/…

    Exit status: 2 bad input (a bad option), 3 bad rule file.
    """
    import asyncio
    import logging
    import signal

    from aiohttp import web

    from ..sidecar.agent import host_port
    from ..diagnosis import load_rules, parse_slo
    from ..oncall.diagnose import Setup
    from ..oncall.service import OnCall, make_app
    from ..timeparse import DURATION, parse_duration

    def seconds(v: str, name: str) -> float:
        if not DURATION.match(v.strip()):
            raise InputError(f"--{name} {v!r}: expected a duration like 30s, 5m, 2h")
        return parse_duration(v)

    if not prometheus.startswith(("http://", "https://")):
        raise InputError(f"--prometheus {prometheus!r}: expected an http(s):// URL")
    for url in forward:
        if not url.startswith(("http://", "https://")):
            raise InputError(f"--forward-webhook {url!r}: expected an http(s):// URL")
    try:
        host, port = host_port(listen, 9095)
    except ValueError:
        raise InputError(f"--listen {listen!r}: expected HOST:PORT") from None
    if queue_max < 1 or workers < 1:
        raise InputError("--queue and --workers: expected at least 1")
    setup = Setup(prometheus, load_rules([Path(d) for d in rules_dirs]), lookback_s=seconds(lookback, "lookback"),
                  before_s=seconds(before, "before"), step_s=seconds(step, "step") if step else None,
                  slo=parse_slo(slo), bearer_token=bearer_token, timeout_s=seconds(prom_timeout, "prom-timeout"),
                  group_by=group_by)
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
