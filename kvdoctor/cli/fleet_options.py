"""`kvdoctor diagnose --prometheus URL`: the fleet options and the command body they run."""
from __future__ import annotations

import time

import click
import orjson

from ..errors import InputError
from . import params as P
from .common import check_range, finish, write_out


def fleet_options(f):
    for option in reversed([
        click.option("--prometheus", metavar="URL|CAPTURE",
                     help="Fleet mode: diagnose every instance a Prometheus server holds (or replay a capture "
                          "saved by `import prometheus-range`)."),
        click.option("--selector", type=P.Selector(), help="Fleet mode: label matchers every query gets."),
        click.option("--gpu-selector", type=P.Selector(), metavar="'{job=\"dcgm\"}'",
                     help="Fleet mode: matchers for DCGM exporter series instead of --selector (they are often another job)."),
        click.option("--sidecar-selector", type=P.Selector(), metavar="'{job=\"kvdoctor\"}'",
                     help="Fleet mode: matchers for kvdoctor sidecars' series instead of --selector."),
        click.option("--start", "prom_start", type=P.TIME,
                     help="Fleet mode: range start (epoch, ISO 8601 or a duration ago)."),
        click.option("--end", "prom_end", type=P.TIME, help="Fleet mode: range end (default now)."),
        click.option("--group-by", type=P.Labels(), default="instance", show_default=True,
                     help="Fleet mode: labels that name an instance, comma separated (e.g. pod or pod,model_name)."),
        click.option("--bearer-token", envvar="KVDOCTOR_PROM_TOKEN", help="Fleet mode: bearer token (or $KVDOCTOR_PROM_TOKEN; "
                     "prefer --bearer-token-file: an argument is visible to every local user in ps)."),
        click.option("--bearer-token-file", type=P.InputFile(), metavar="FILE",
                     help="Fleet mode: read the bearer token from this file (first line)."),
        click.option("--basic-auth", type=P.UserPass(), help="Fleet mode: HTTP basic auth."),
        click.option("--ca-file", type=P.InputFile(), help="Fleet mode: CA bundle for https."),
        click.option("--insecure", is_flag=True, help="Fleet mode: do not verify the TLS certificate."),
        click.option("--prom-timeout", type=P.Duration(max_s=3600), default=P.PROM_TIMEOUT, show_default=True,
                     help="Fleet mode: timeout per query."),
    ]):
        f = option(f)
    return f


#: the options that mean something only with --prometheus (fleet mode)
FLEET_ONLY = ("selector", "gpu_selector", "sidecar_selector", "prom_start", "prom_end", "group_by", "bearer_token",
              "bearer_token_file", "basic_auth", "ca_file", "insecure", "prom_timeout")


def check_fleet_only(kw: dict) -> None:
    """A fleet-mode option given without --prometheus would be ignored in silence: refused."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or kw.get("prometheus"):
        return
    for name in FLEET_ONLY:
        source = ctx.get_parameter_source(name)
        if source in (click.core.ParameterSource.COMMANDLINE,):
            opt = next(p for p in ctx.command.params if p.name == name).opts[-1]
            raise InputError(f"{opt} applies to fleet mode only; give --prometheus URL too, or leave it out")


def explicit_step(step: float | None) -> float | None:
    """``--step`` as given, or None when the user left it at its default: fleet mode then chooses
    the query step from the range and the scrape interval (a capture's default stays 1m)."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.get_parameter_source("step") == click.core.ParameterSource.DEFAULT:
        return None
    return step


def duration_text(seconds: float) -> str:
    """Seconds as the fleet package's duration strings take them (``90s``, ``0.5s``)."""
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def _instant_text(value, name: str) -> str | None:
    """A --since/--until/--start/--end for Prometheus: absolute, or a duration before now."""
    if value is None:
        return None
    if value.after_start_s is not None:
        raise InputError(f"--{name} {value}: +DURATION counts from a capture's start; in fleet mode give a "
                         "duration ago (2h) or a time")
    return str(value)


def fleet_diagnosis(prometheus, selector, since, until, prom_start, prom_end, step, lookback, group_by, rules_dirs,
                    objectives, sets, bearer_token, basic_auth, ca_file, insecure, prom_timeout,
                    gpu_selector=None, sidecar_selector=None, bearer_token_file=None, **_unused):
    """Fetch (or replay) and diagnose every instance: the FleetDiagnosis that diagnose and report render."""
    # fleet mode only: `diagnose CAPTURE` does not import the Prometheus client
    from ..diagnosis import Options
    from ..fleet import diagnose_fleet
    from ..prometheus import fetch_from_options
    from .attach import read_token
    from .common import load_rules_checked

    texts = [_instant_text(v, n) for v, n in ((since, "since"), (until, "until"), (prom_start, "start"), (prom_end, "end"))]
    now = time.time()
    lo = (prom_start or since)
    hi = (prom_end or until)
    check_range(lo.resolve(None, now) if lo else None, hi.resolve(None, now) if hi else None, lo, hi, now)
    bearer_token = read_token(bearer_token, bearer_token_file, "--bearer-token") if (bearer_token or bearer_token_file) else None
    step = explicit_step(step)
    data = fetch_from_options(prometheus, selector, *texts,
                              duration_text(step) if step is not None else None, group_by,
                              bearer_token, basic_auth, ca_file, insecure, duration_text(prom_timeout),
                              gpu_selector=gpu_selector, sidecar_selector=sidecar_selector)
    if not data.samples:
        from ..errors import SourceError

        why = data.warnings[0].removeprefix("warning: ") if data.warnings else "no instances in the range"
        more = f" (and {len(data.warnings) - 1} more warnings)" if len(data.warnings) > 1 else ""
        raise SourceError(f"nothing to diagnose from {data.source}: {why}{more}")
    lookback_s = lookback
    eval_step_s = step if step is not None else data.step_s
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.get_parameter_source("lookback") == click.core.ParameterSource.DEFAULT:
        from ..prometheus import auto_window

        # a window no longer than a fifth of the range: a short overload must not be averaged away
        lookback_s, auto_eval = auto_window(data.end_s - data.start_s, data.step_s, lookback_s)
        if step is None:
            eval_step_s = auto_eval
    from ..prometheus import thin_warnings

    data.warnings += [w for w in thin_warnings(data, lookback_s) if w not in data.warnings]
    for w in data.warnings:
        click.echo(w, err=True)
    opts = Options(lookback_s=lookback_s, step_s=eval_step_s, **objectives)
    rules = load_rules_checked(rules_dirs, sets)
    return diagnose_fleet(data, rules, opts)


def fleet_finish(fd, fail_on: str | None) -> None:
    """Exit 6 when no replica had anything to judge, 7 for --fail-on (any replica's incident)."""
    reasons = [r.json.get("nothing_to_diagnose") for r in fd.per_instance.values()]
    if reasons and all(reasons):
        from ..errors import NothingToDiagnose

        raise NothingToDiagnose(f"every replica: {reasons[0]}")
    finish([], fail_on, incidents=[i for r in fd.per_instance.values() for i in r.incidents])


def run_fleet(prometheus, selector, *, fmt, output, fail_on=None, **kwargs) -> None:
    """`kvdoctor diagnose --prometheus`: the fleet diagnosis as text or JSON."""
    from ..report.fleet_text import render_text

    if fmt == "markdown":
        raise InputError("--format markdown: fleet mode prints text or json")
    fd = fleet_diagnosis(prometheus, selector, **kwargs)
    if fmt == "json":
        text = orjson.dumps(fd.to_json(), option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n"
    else:
        text = render_text(fd)
    write_out(text, output)
    fleet_finish(fd, fail_on)
