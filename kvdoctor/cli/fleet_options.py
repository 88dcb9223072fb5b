"""`kvdoctor diagnose --prometheus URL`: the fleet options and the command body they run."""
from __future__ import annotations

from pathlib import Path

import click
import orjson

from ..errors import InputError
from .common import write_out


def fleet_options(f):
    for option in reversed([
        click.option("--prometheus", metavar="URL|CAPTURE",
                     help="Fleet mode: diagnose every instance a Prometheus server holds (or replay a capture "
                          "saved by `import prometheus-range`)."),
        click.option("--selector", metavar="'{job=\"vllm\"}'", help="Fleet mode: label matchers every query gets."),
        click.option("--gpu-selector", metavar="'{job=\"dcgm\"}'",
                     help="Fleet mode: matchers for DCGM exporter series instead of --selector (they are often another job)."),
        click.option("--sidecar-selector", metavar="'{job=\"kvdoctor\"}'",
                     help="Fleet mode: matchers for kvdoctor sidecars' series instead of --selector."),
        click.option("--start", "prom_start", help="Fleet mode: range start (epoch, ISO 8601 or a duration ago)."),
        click.option("--end", "prom_end", help="Fleet mode: range end (default now)."),
        click.option("--group-by", default="instance", show_default=True,
                     help="Fleet mode: labels that name an instance, comma separated (e.g. pod or pod,model_name)."),
        click.option("--bearer-token", envvar="KVDOCTOR_PROM_TOKEN", help="Fleet mode: bearer token (or $KVDOCTOR_PROM_TOKEN)."),
        click.option("--basic-auth", metavar="USER:PASS", help="Fleet mode: HTTP basic auth."),
        click.option("--ca-file", type=click.Path(), help="Fleet mode: CA bundle for https."),
        click.option("--insecure", is_flag=True, help="Fleet mode: do not verify the TLS certificate."),
        click.option("--prom-timeout", default="60s", show_default=True, help="Fleet mode: timeout per query."),
    ]):
        f = option(f)
    return f


def fetch_from_options(prometheus: str, selector, since, until, prom_start, prom_end, step, group_by,
                       bearer_token, basic_auth, ca_file, insecure, prom_timeout, default_since: str = "1h",
                       gpu_selector: str | None = None, sidecar_selector: str | None = None):
    """FleetData from a Prometheus URL, or from a saved capture folder (offline replay)."""
    from ..fleet import PromClient, fetch, from_capture
    from ..fleet.query import Selectors, parse_duration, time_range

    if not prometheus.startswith(("http://", "https://")):
        if Path(prometheus).is_dir():
            return from_capture(prometheus)
        raise InputError(f"--prometheus {prometheus!r}: expected an http(s):// URL or a capture folder")
    if basic_auth and ":" not in basic_auth:
        raise InputError("--basic-auth: expected USER:PASS")
    t0, t1 = time_range(since, prom_start, prom_end, until, default_since=default_since)
    step_s = parse_duration(step, "step")
    client = PromClient(prometheus, bearer_token=bearer_token, basic_auth=basic_auth, ca_file=ca_file,
                        insecure=insecure, timeout_s=parse_duration(prom_timeout, "prom-timeout"))
    groups = tuple(g.strip() for g in group_by.split(",") if g.strip()) or ("instance",)
    return fetch(client, t0, t1, step_s, Selectors.parse(selector, gpu_selector, sidecar_selector), groups)


def fleet_diagnosis(prometheus, selector, since, until, prom_start, prom_end, step, lookback, group_by, rules_dirs,
                    slo, sets, bearer_token, basic_auth, ca_file, insecure, prom_timeout,
                    gpu_selector=None, sidecar_selector=None):
    """Fetch (or replay) and diagnose every instance: the FleetDiagnosis that diagnose and report render."""
    from ..diagnosis import Options, load_rules, parse_slo
    from ..diagnosis.rules import parse_duration, parse_overrides
    from ..fleet import diagnose_fleet

    data = fetch_from_options(prometheus, selector, since, until, prom_start, prom_end, step, group_by,
                              bearer_token, basic_auth, ca_file, insecure, prom_timeout,
                              gpu_selector=gpu_selector, sidecar_selector=sidecar_selector)
    if not data.samples:
        from ..errors import SourceError

        why = data.warnings[0].removeprefix("warning: ") if data.warnings else "no instances in the range"
        more = f" (and {len(data.warnings) - 1} more warnings)" if len(data.warnings) > 1 else ""
        raise SourceError(f"nothing to diagnose from {data.source}: {why}{more}")
    for w in data.warnings:
        click.echo(w, err=True)
    try:
        opts = Options(lookback_s=parse_duration(lookback), step_s=parse_duration(step), slo=parse_slo(slo))
    except ValueError as e:
        raise InputError(f"--lookback/--step: {e}") from None
    rules = load_rules([Path(d) for d in rules_dirs], parse_overrides(sets))
    return diagnose_fleet(data, rules, opts)


def run_fleet(prometheus, selector, *args, fmt, output, **kwargs) -> None:
    """`kvdoctor diagnose --prometheus`: the fleet diagnosis as text or JSON."""
    from ..fleet import render_text

    fd = fleet_diagnosis(prometheus, selector, *args, **kwargs)
    if fmt == "json":
        text = orjson.dumps(fd.to_json(), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n"
    else:
        text = render_text(fd)
    write_out(text, output)
