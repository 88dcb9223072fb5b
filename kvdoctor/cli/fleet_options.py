"""`kvdoctor diagnose --prometheus URL`: the fleet options and the command body they run."""
from __future__ import annotations

from pathlib import Path

import click
import orjson

from ..errors import InputError
from ..prometheus import fetch_from_options  # noqa: F401  (the commands call it from here too)
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


def explicit_step(step: str | None) -> str | None:
    """``--step`` as given, or None when the user left it at its default: fleet mode then chooses
    the query step from the range and the scrape interval (a capture's default stays 1m)."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.get_parameter_source("step") == click.core.ParameterSource.DEFAULT:
        return None
    return step


def fleet_diagnosis(prometheus, selector, since, until, prom_start, prom_end, step, lookback, group_by, rules_dirs,
                    slo, sets, bearer_token, basic_auth, ca_file, insecure, prom_timeout,
                    gpu_selector=None, sidecar_selector=None):
    """Fetch (or replay) and diagnose every instance: the FleetDiagnosis that diagnose and report render."""
    from ..diagnosis import Options, load_rules, parse_slo
    from ..diagnosis.rules import parse_duration, parse_overrides
    from ..fleet import diagnose_fleet

    step = explicit_step(step)
    data = fetch_from_options(prometheus, selector, since, until, prom_start, prom_end, step, group_by,
                              bearer_token, basic_auth, ca_file, insecure, prom_timeout,
                              gpu_selector=gpu_selector, sidecar_selector=sidecar_selector)
    if not data.samples:
        from ..errors import SourceError

        why = data.warnings[0].removeprefix("warning: ") if data.warnings else "no instances in the range"
        more = f" (and {len(data.warnings) - 1} more warnings)" if len(data.warnings) > 1 else ""
        raise SourceError(f"nothing to diagnose from {data.source}: {why}{more}")
    try:
        lookback_s = parse_duration(lookback)
        eval_step_s = parse_duration(step) if step not in (None, "auto") else data.step_s
    except ValueError as e:
        raise InputError(f"--lookback/--step: {e}") from None
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.get_parameter_source("lookback") == click.core.ParameterSource.DEFAULT:
        from ..prometheus import auto_window

        # a window no longer than a fifth of the range: a short overload must not be averaged away
        lookback_s, auto_eval = auto_window(data.end_s - data.start_s, data.step_s, lookback_s)
        if step in (None, "auto"):
            eval_step_s = auto_eval
    from ..prometheus import thin_warnings

    data.warnings += [w for w in thin_warnings(data, lookback_s) if w not in data.warnings]
    for w in data.warnings:
        click.echo(w, err=True)
    try:
        opts = Options(lookback_s=lookback_s, step_s=eval_step_s, slo=parse_slo(slo))
    except ValueError as e:
        raise InputError(f"--lookback/--step: {e}") from None
    rules = load_rules([Path(d) for d in rules_dirs], parse_overrides(sets))
    return diagnose_fleet(data, rules, opts)


def run_fleet(prometheus, selector, *args, fmt, output, **kwargs) -> None:
    """`kvdoctor diagnose --prometheus`: the fleet diagnosis as text or JSON."""
    from ..report.fleet_text import render_text

    fd = fleet_diagnosis(prometheus, selector, *args, **kwargs)
    if fmt == "json":
        text = orjson.dumps(fd.to_json(), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n"
    else:
        text = render_text(fd)
    write_out(text, output)
