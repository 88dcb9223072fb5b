"""Small pieces the commands share: output, the objective options, rule loading, time ranges,
and how a diagnosing command ends (exit 6 when nothing was judged, 7 for --fail-on)."""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import click

from ..errors import EXIT_FAIL_ON, InputError, KvdoctorError, NothingToDiagnose
from ..timeparse import iso_utc
from ..units import printable
from . import params as P


@contextlib.contextmanager
def progress_callback(desc: str, unit: str = "it") -> Iterator[Callable[[int, int], None] | None]:
    """A ``callback(done, total)`` drawing a progress bar on a terminal; None when piped,
    so scripts and CI logs stay clean."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


#: C0 controls but tab and newline, DEL and C1 controls: bytes from a capture, a trace file or an
#: upstream that a terminal would act on (colour, cursor moves, title changes, ...)
def write_out(text: str, output: str | None) -> None:
    """A command's result: to the --output file when given, else to standard output; control
    characters from the data never reach a terminal (nor a file someone will cat)."""
    text = printable(text)
    if output and output != "-":
        try:
            Path(output).write_text(text, encoding="utf-8")
        except OSError as e:
            raise InputError(f"-o {output}: cannot write ({e.strerror or e})") from None
    else:
        sys.stdout.write(text)


# -- options every printing command shares -----------------------------------------------------

def format_option(choices: tuple[str, ...] = ("text", "markdown", "json")):
    return click.option("--format", "fmt", type=click.Choice(choices), default="text", show_default=True,
                        help="How to print the result.")


output_option = click.option("-o", "--output", type=P.OutputFile(dash_ok=True), metavar="FILE",
                             help="Write the result here instead of standard output (its folder must exist).")


# -- objectives (issue 31): --slo, --slo-file, --workload, --no-default-slo ---------------------

def _objectives_help() -> str:
    from ..objectives import WORKLOADS, Objective

    def said(workload: str) -> str:
        objs = [Objective(s, t, "default") for s, t in WORKLOADS[workload].items()]
        return ", ".join(f"{o.label} {_target(o)}" for o in objs)

    return ("Objective, repeatable: --slo ttft_p99=2s --slo tpot_p99=80ms --slo error_rate=1% (ttft, tpot, itl, "
            "e2e, queue at p50/p90/p99, or error_rate). Over the defaults of --workload: "
            + "; ".join(f"{w}: {said(w)}" for w in WORKLOADS) + ". --no-default-slo turns the defaults off.")


def _target(o) -> str:
    if o.unit == "fraction":
        return f"{o.target * 100:g}%"
    return f"{o.target * 1000:g} ms" if o.target < 1 else f"{o.target:g} s"


def _check_slo_file(ctx, param, value):
    if value is not None:
        from ..objectives import load_slo_file

        load_slo_file(value)  # a bad file is one located line (exit 2) before anything is loaded
    return value


def objective_options(f):
    """--slo, --slo-file, --workload and --no-default-slo: the objectives a diagnosis judges."""
    from ..objectives import DEFAULT_WORKLOAD, WORKLOADS

    for option in reversed([
        click.option("--slo", multiple=True, type=P.OBJECTIVE, help=_objectives_help()),
        click.option("--slo-file", type=P.InputFile(), callback=_check_slo_file, metavar="FILE",
                     help="Objectives from a kvdoctor.yaml: slo: for every model, models: NAME: slo: per served "
                          "model (docs/cli.md); --slo wins over it."),
        click.option("--workload", type=click.Choice(list(WORKLOADS)), default=None,
                     help=f"Workload class whose default objectives apply [default: the SLO file's, else "
                          f"{DEFAULT_WORKLOAD}]."),
        click.option("--no-default-slo", is_flag=True, help="Judge only the objectives stated (--slo, --slo-file)."),
    ]):
        f = option(f)
    return f


def objective_kwargs(slo: Iterable[str], slo_file: str | None, workload: str | None,
                     no_default_slo: bool) -> dict[str, Any]:
    """The objective fields of kvdoctor.diagnosis.Options."""
    from ..objectives import parse_slo

    return {"slo": parse_slo(slo), "workload": workload, "slo_file": slo_file,
            "default_objectives": not no_default_slo}


def pop_objectives(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the four objective options out of a command's keyword arguments, as Options fields."""
    return objective_kwargs(kwargs.pop("slo", ()), kwargs.pop("slo_file", None), kwargs.pop("workload", None),
                            kwargs.pop("no_default_slo", False))


# -- rules ---------------------------------------------------------------------------------------

def load_rules_checked(rules_dirs: Iterable[str], sets: Iterable[str]) -> list:
    """The rules with --set applied; a --set that names no rule or parameter is bad input (2),
    not a bad rule file (3)."""
    import re

    from ..diagnosis import load_rules

    overrides: dict[str, dict[str, float]] = {}
    for item in sets:
        m = re.fullmatch(r"([a-z][a-z0-9-]*)\.([a-z_][a-z0-9_]*)=([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)",
                         str(item).strip())
        if not m or not _finite(m[3]):
            raise InputError(f"--set {item!r}: expected RULE.PARAM=NUMBER, e.g. prefill-bound.min_corr=0.5")
        overrides.setdefault(m[1], {})[m[2]] = float(m[3])
    dirs = [Path(d) for d in rules_dirs]
    rules = load_rules(dirs)
    if not overrides:
        return rules
    by_id = {r.id: r for r in rules}
    for rid, values in overrides.items():
        if rid not in by_id:
            raise InputError(f"--set {rid}.{next(iter(values))}: no rule {rid!r}; `kvdoctor rules list` shows the ids")
        for key in values:
            if key not in by_id[rid].params:
                known = ", ".join(by_id[rid].params) or "none"
                raise InputError(f"--set {rid}.{key}: rule {rid} has no parameter {key!r}; known: {known}")
    return load_rules(dirs, overrides)


def _finite(text: str) -> bool:
    import math

    return math.isfinite(float(text))


def rules_option(f):
    return click.option("--rules", "rules_dirs", multiple=True, type=P.InputFile(dir_okay=True, file_okay=False),
                        help="Extra folder of rule files (repeatable); same id replaces a shipped rule.")(f)


def set_option(f):
    return click.option("--set", "sets", multiple=True, metavar="RULE.PARAM=N",
                        help="Override a rule threshold, e.g. --set prefill-bound.min_corr=0.5.")(f)


# -- time ranges ---------------------------------------------------------------------------------

#: a --since this far past the clock is a typo or a wrong zone, not a range to wait for
FUTURE_SLACK_S = 60.0

TIME_HELP = ("ISO 8601 (2026-11-30T08:00:00Z), epoch seconds, a duration ago (2h: before the capture's "
             "end; in fleet mode before now) or +DURATION after the capture's start")


def since_until_options(f):
    for option in reversed([
        click.option("--since", type=P.TIME, help=f"Only from this time: {TIME_HELP}."),
        click.option("--until", type=P.TIME, help="Only up to this time (same forms as --since)."),
    ]):
        f = option(f)
    return f


def check_range(lo: float | None, hi: float | None, since=None, until=None, now: float | None = None) -> None:
    """Refuse an inverted range and one wholly in the future (bad input, exit 2)."""
    now = time.time() if now is None else now
    if lo is not None and hi is not None and hi <= lo:
        raise InputError(f"--since {since} ({_iso(lo)}) is not before --until {until} ({_iso(hi)}): the range is empty")
    if lo is not None and lo > now + FUTURE_SLACK_S:
        raise InputError(f"--since {since}: {_iso(lo)} is in the future (now {_iso(now)}); nothing can be in that range")


def load_capture(path: str, since=None, until=None):
    """A capture cut to --since/--until (relative times against the capture's own start and
    end); the cut capture carries ``range_text`` for the nothing-to-diagnose reason."""
    from ..capture import load

    keep_freed_memory()

    if since is not None and until is not None and since.absolute and until.absolute:
        check_range(since.epoch_s, until.epoch_s, since, until)  # before the capture is read
    if since is None and until is None:
        return load(path)

    def range_of(start_s: float | None, end_s: float | None) -> tuple[float | None, float | None]:
        # the capture's span from its segment index: only the segments the range meets are read
        end = end_s if end_s is not None else time.time()
        lo = since.resolve(start_s, end) if since is not None else None
        hi = until.resolve(start_s, end) if until is not None else None
        check_range(lo, hi, since, until)
        return lo, hi

    cap = load(path, range_of=range_of)
    import dataclasses

    lo, hi = cap.range_s or (None, None)
    text = f"{_iso(lo) if lo is not None else '…'} → {_iso(hi) if hi is not None else '…'}"
    return dataclasses.replace(cap, range_text=text)


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> None:
    """For a batch command (one capture in, a report out): keep memory the process frees for its
    next allocations instead of handing it back to the kernel. Analysing a capture allocates and
    frees arrays as long as the capture (8 MB a million requests) thousands of times; glibc
    returns each to the kernel and the next one is faulted in again page by page (a 1M-request
    diagnose spent a fifth of its time in the kernel). Peak RSS is unchanged: what is kept is
    what the next array reuses. Not for long-running commands (attach), whose RSS should fall
    back after a peak. A no-op where the C library is not glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    mallopt(_M_TRIM_THRESHOLD, 1 << 30)


def _iso(t: float) -> str:
    try:
        return iso_utc(t)
    except (OverflowError, OSError, ValueError):
        return f"{t:g}"


# -- how a diagnosing command ends ---------------------------------------------------------------

class FailOn(KvdoctorError):
    """--fail-on found an incident at or above its severity (exit 7)."""

    exit_code = EXIT_FAIL_ON
    label = "fail-on"


fail_on_option = click.option("--fail-on", type=click.Choice(["warning", "critical"]), default=None,
                              help="Exit 7 when an incident at or above this severity was found (after printing "
                                   "the result), for CI and cron.")


def finish(diagnoses: list, fail_on: str | None, incidents: list | None = None) -> None:
    """After the result is printed: exit 6 when none of ``diagnoses`` had anything to judge (the
    reason on one stderr line), 7 when ``fail_on`` is set and an incident reached it."""
    reasons = [d.nothing_to_diagnose for d in diagnoses if getattr(d, "nothing_to_diagnose", None)]
    if diagnoses and len(reasons) == len(diagnoses):
        raise NothingToDiagnose(reasons[0])
    if not fail_on:
        return
    from ..diagnosis.rules import SEVERITY_RANK

    found = incidents if incidents is not None else [i for d in diagnoses for i in d.incidents]
    hits = [i for i in found if SEVERITY_RANK[i.severity] >= SEVERITY_RANK[fail_on]]
    if hits:
        names = ", ".join(f"{i.causes[0].rule.id} ({i.severity})" for i in hits[:3]) + (", ..." if len(hits) > 3 else "")
        e = FailOn(f"{len(hits)} incident{'s' * (len(hits) != 1)} at or above {fail_on}: {names}")
        e.label = f"--fail-on {fail_on}"
        raise e
