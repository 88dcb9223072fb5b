"""`kvdoctor diagnose` and `kvdoctor summary`."""
from __future__ import annotations

from pathlib import Path

import click
import orjson

from ..errors import InputError
from ..timeparse import epoch_or_iso
from .common import progress_callback, write_out
from .fleet_options import fleet_options, run_fleet  # fleet mode


def _time(value: str | None, name: str) -> float | None:
    if value is None:
        return None
    t = epoch_or_iso(value)
    if t is None:
        raise InputError(f"--{name} {value!r}: expected epoch seconds or an ISO time like 2026-11-30T08:00:00Z")
    return t


def run_diagnosis(capture: str, since: str | None, until: str | None, rules_dirs: tuple[str, ...],
                  slo: tuple[str, ...], sets: tuple[str, ...], lookback: str, step: str,
                  max_model_len: int | None = None):
    from ..capture import load
    from ..diagnosis import Options, diagnose, load_rules, parse_slo
    from ..diagnosis.rules import parse_duration, parse_overrides

    try:
        opts = Options(lookback_s=parse_duration(lookback), step_s=parse_duration(step), slo=parse_slo(slo),
                       max_model_len_tokens=max_model_len)
    except ValueError as e:
        raise InputError(f"--lookback/--step: {e}") from None
    rules = load_rules([Path(d) for d in rules_dirs], parse_overrides(sets))
    cap = load(capture, since_s=_time(since, "since"), until_s=_time(until, "until"))
    with progress_callback("diagnosing", unit="windows") as progress:
        return diagnose(cap, rules, opts, progress)


def diagnosis_options(f=None, *, capture_required: bool = True):
    """The options diagnose, summary and report share (CAPTURE is optional only where
    --prometheus can stand in for it)."""
    if f is None:
        return lambda g: diagnosis_options(g, capture_required=capture_required)
    for option in reversed([
        click.argument("capture", type=click.Path(), required=capture_required),
        click.option("--since", help="Only from this time (epoch seconds or ISO 8601)."),
        click.option("--until", help="Only up to this time (epoch seconds or ISO 8601)."),
        click.option("--rules", "rules_dirs", multiple=True, type=click.Path(),
                     help="Extra folder of rule files (repeatable); same id replaces a shipped rule."),
        click.option("--slo", multiple=True, metavar="NAME=VALUE",
                     help="Absolute objective, e.g. --slo ttft_p99=2s --slo tpot_p99=80ms --slo error_rate=1%."),
        click.option("--set", "sets", multiple=True, metavar="RULE.PARAM=N",
                     help="Override a rule threshold, e.g. --set prefill-bound.min_corr=0.5."),
        click.option("--lookback", default="5m", show_default=True, help="Window each evaluation looks back over."),
        click.option("--step", default="1m", show_default=True, help="Time between evaluations."),
        click.option("--max-model-len", type=click.IntRange(min=1), metavar="TOKENS",
                     help="The server's context limit, where the capture does not record it (imports): "
                          "lets prompt-length-tail run. Default: engine info, else the model table."),
    ]):
        f = option(f)
    return f


@click.command("diagnose")
@diagnosis_options(capture_required=False)  # fleet mode (--prometheus) stands in for CAPTURE
@click.option("--format", "fmt", type=click.Choice(["text", "markdown", "json"]), default="text", show_default=True)
@click.option("-o", "--output", type=click.Path(), help="Write here instead of standard output.")
@fleet_options  # --- fleet mode (kvdoctor/cli/fleet_options.py) ---
def command(capture, since, until, rules_dirs, slo, sets, lookback, step, max_model_len, fmt, output, **fleet):
    """Incidents in a capture, each with its ranked causes, evidence numbers and fixes.

    \b
    Examples:
      kvdoctor diagnose samples/multi-turn
      kvdoctor diagnose cap/ --format json | jq '.incidents[0].causes[0]'
      kvdoctor diagnose cap/ --slo ttft_p99=2s --since 2026-11-30T02:00:00Z
      kvdoctor diagnose cap/ --rules my-rules/ --set prefill-bound.min_corr=0.5
      kvdoctor diagnose --prometheus http://prom:9090 --selector '{job="vllm"}' --since 2h   # a fleet

    Exit status: 0 done (incidents or not), 2 bad input, 3 bad rule file, 4 nothing could be
    read from --prometheus (refused, unreachable, no engine metrics under the selector).
    """
    from ..report.summary import full_text, markdown

    # --- fleet mode: every instance behind a Prometheus server (docs/fleet.md) ---
    if fleet.get("prometheus"):
        if capture:
            raise InputError("give either CAPTURE or --prometheus, not both")
        return run_fleet(fleet.pop("prometheus"), fleet.pop("selector"), since, until, step=step, lookback=lookback,
                         rules_dirs=rules_dirs, slo=slo, sets=sets, fmt=fmt, output=output, **fleet)
    if not capture:
        raise InputError("missing CAPTURE (or --prometheus URL for fleet mode)")
    # --- end fleet mode ---
    diag = run_diagnosis(capture, since, until, rules_dirs, slo, sets, lookback, step, max_model_len)
    if fmt == "json":
        text = orjson.dumps(diag.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n"
    elif fmt == "markdown":
        text = markdown(diag)
    else:
        text = full_text(diag)
    write_out(text, output)
