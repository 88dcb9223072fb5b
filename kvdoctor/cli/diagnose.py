"""`kvdoctor diagnose` (and the options and diagnosis run that summary and report share)."""
from __future__ import annotations

import click
import orjson

from ..errors import InputError
from . import params as P
from .common import (fail_on_option, finish, format_option, load_capture, load_rules_checked, objective_options,
                     output_option, pop_objectives, progress_callback, rules_option, set_option, since_until_options,
                     write_out)
from .fleet_options import check_fleet_only, fleet_options, run_fleet  # fleet mode


def run_diagnosis(capture: str, since=None, until=None, rules_dirs: tuple[str, ...] = (), objectives: dict | None = None,
                  sets: tuple[str, ...] = (), lookback: float = 300.0, step: float = 60.0,
                  max_model_len: int | None = None):
    """Load CAPTURE (cut to --since/--until) and diagnose it with the shipped and --rules rules."""
    from ..diagnosis import Options, diagnose

    # workers=0: a large capture's windows are judged on every core (forked; small ones here)
    opts = Options(lookback_s=lookback, step_s=step, max_model_len_tokens=max_model_len, workers=0, **(objectives or {}))
    rules = load_rules_checked(rules_dirs, sets)
    cap = load_capture(capture, since, until)
    with progress_callback("diagnosing", unit="windows") as progress:
        return diagnose(cap, rules, opts, progress)


def diagnosis_options(f=None, *, capture_required: bool = True):
    """The options diagnose, summary and report share (CAPTURE is optional only where
    --prometheus can stand in for it)."""
    if f is None:
        return lambda g: diagnosis_options(g, capture_required=capture_required)
    for option in reversed([
        click.argument("capture", type=click.Path(), required=capture_required),
        since_until_options,
        rules_option,
        objective_options,
        set_option,
        click.option("--lookback", type=P.Duration(min_s=0.001), default="5m", show_default=True,
                     help="Window each evaluation looks back over."),
        click.option("--step", type=P.Duration(min_s=0.001), default="1m", show_default=True,
                     help="Time between evaluations."),
        click.option("--max-model-len", type=P.TOKENS, metavar="TOKENS",
                     help="The server's context limit, where the capture does not record it (imports): "
                          "lets prompt-length-tail run. Default: engine info, else the model table."),
        fail_on_option,
    ]):
        f = option(f)
    return f


def diagnosis_args(kw: dict) -> dict:
    """run_diagnosis's keyword arguments from a command's (the objective options folded into one)."""
    objectives = pop_objectives(kw)
    return {"since": kw.pop("since"), "until": kw.pop("until"), "rules_dirs": kw.pop("rules_dirs"),
            "objectives": objectives, "sets": kw.pop("sets"), "lookback": kw.pop("lookback"), "step": kw.pop("step"),
            "max_model_len": kw.pop("max_model_len")}


@click.command("diagnose")
@diagnosis_options(capture_required=False)  # fleet mode (--prometheus) stands in for CAPTURE
@format_option()
@output_option
@fleet_options  # --- fleet mode (kvdoctor/cli/fleet_options.py) ---
def command(capture, fmt, output, fail_on, **kw):
    """Incidents in a capture, each with its ranked causes, evidence numbers and fixes.

    \b
    Examples:
      kvdoctor diagnose samples/multi-turn
      kvdoctor diagnose cap/ --format json | jq '.incidents[0].causes[0]'
      kvdoctor diagnose cap/ --slo ttft_p99=2s --since 2026-11-30T02:00:00Z
      kvdoctor diagnose cap/ --workload interactive --fail-on critical      # CI: exit 7 on a critical incident
      kvdoctor diagnose cap/ --rules my-rules/ --set prefill-bound.min_corr=0.5
      kvdoctor diagnose --prometheus http://prom:9090 --selector '{job="vllm"}' --since 2h   # a fleet
    """
    # --- fleet mode: every instance behind a Prometheus server (docs/fleet.md) ---
    if kw.get("prometheus"):
        if capture:
            raise InputError("give either CAPTURE or --prometheus, not both")
        args = diagnosis_args(kw)
        if args.pop("max_model_len"):
            raise InputError("--max-model-len applies to a capture; fleet mode reads the engines' own limits")
        return run_fleet(kw.pop("prometheus"), kw.pop("selector"), fmt=fmt, output=output, fail_on=fail_on,
                         **args, **kw)
    check_fleet_only(kw)
    if not capture:
        raise InputError("missing CAPTURE (or --prometheus URL for fleet mode)")
    # --- end fleet mode ---
    diag = run_diagnosis(capture, **diagnosis_args(kw))
    if fmt == "json":
        text = orjson.dumps(diag.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n"
    else:  # the text renderers only where text is asked for
        from ..report.summary import full_text, markdown

        text = markdown(diag) if fmt == "markdown" else full_text(diag)
    write_out(text, output)
    finish([diag], fail_on)
