"""Issue 35, "no exit 70 and no exit 0 on nonsense": every option of every command, walked from
the click command tree, gets the bad values of its kind (negative, zero, huge, wrong unit, bytes
that are not UTF-8, a missing path, an existing path where a new one is expected). Each must end
with exit 2 (kvdoctor.errors.EXIT_CODES), exactly one line on stderr, no traceback, nothing on
stdout, and nothing written or deleted in the working folder.

The kind comes from the option's click type (kvdoctor/cli/params.py). An option whose type says
nothing (a plain string or path) must be declared in DECLARED below with its own bad values, so
a new option fails this test until someone says what nonsense for it looks like."""
from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvdoctor.cli import COMMANDS, cli
from kvdoctor.cli import params as P
from kvdoctor.errors import EXIT_CODES

ROOT = Path(__file__).resolve().parents[1]
BAD_UTF8 = "\udcff"  # what Python makes of a 0xff byte in argv (surrogateescape)
BAD_INPUT = 2
assert EXIT_CODES[BAD_INPUT].startswith("bad input")

CAPTURE_ARG = ["missing_cap", "existing.txt", "existing_dir", BAD_UTF8]
SETS = ["nope", "prefill-bound.nope=1", "nope.x=1", "prefill-bound.min_corr=1e999"]
FLEET = [("prometheus", ["--prometheus", "http://127.0.0.1:9"])]
#: options a click type cannot judge: (command, parameter name) -> bad values ([] = any text is fine)
DECLARED: dict[tuple[str, str], list[str]] = {
    **{(c, "capture"): CAPTURE_ARG for c in ("diagnose", "summary", "report", "export", "advise")},
    ("report", "after"): CAPTURE_ARG,
    **{(c, "sets"): SETS for c in ("diagnose", "summary", "report", "compare")},
    **{(c, "prometheus"): ["ftp://x", "missing_cap"] for c in ("diagnose", "report")},
    **{(c, name): ["has space", "é"] for c in ("diagnose", "report") for name in ("bearer_token",)},
    ("report", "title"): [],
    ("compare", "before"): ["missing_cap", "cap@nonsense", "cap@+50..+10", BAD_UTF8],
    ("compare", "after"): ["missing_cap", "cap@nonsense", "cap@+50..+10", BAD_UTF8],
    ("advise", "model"): ["NoSuchModel-7B", BAD_UTF8],
    ("advise", "gpu_mem"): ["Z9000", "-80GiB", "0"],
    ("plan", "model"): ["NoSuchModel-7B", BAD_UTF8],
    ("plan", "gpu_mem"): ["Z9000", "-80GiB", "0"],
    ("plan", "kv_dtype"): ["fp3", BAD_UTF8],
    ("plan", "params"): ["8", "-8B", "1e30", "abc"],
    ("plan", "capture"): ["missing_cap", "existing.txt"],
    ("import", "fmt"): ["nope", BAD_UTF8],
    ("import", "src"): ["missing.file", "existing_dir", BAD_UTF8],
    ("import", "cols"): ["novalue", "ttft_s=ttft"],  # --col is for csv; the base imports llmperf
    ("import", "opts"): ["novalue", "nope=1"],
    ("import", "model"): ["", "bad\x00name"],
    ("attach", "token"): ["has space", "é"],
    ("attach", "token_file"): ["missing.file", "existing_dir", "empty.txt"],
    ("attach", "engine_config"): ["novalue", "BAD KEY=1"],
    ("attach", "gpu"): ["Z9000", "-1"],
    ("oncall", "token"): ["has space"],
    ("oncall", "token_file"): ["missing.file", "empty.txt"],
    ("oncall", "bearer_token"): ["has space"],
    ("oncall", "bearer_token_file"): ["missing.file", "empty.txt"],
    ("quality", "candidate_config"): ["novalue"],
    ("rules show", "rule_id"): ["nope", BAD_UTF8],
    ("rules test", "only"): ["nope"],
}
#: more bad values for one option, beyond its kind's
EXTRA: dict[tuple[str, str], list[str]] = {
    **{(c, "since"): ["2099-01-01"] for c in ("diagnose", "summary", "report", "export", "advise")},
    ("attach", "capture_dir"): ["existing_dir"],
    ("import", "out"): ["existing_dir"],
}
#: the valid invocation each bad value is put into: (parameter name, its tokens), in order
BASE: dict[str, list[tuple[str, list[str]]]] = {
    "advise": [("capture", ["cap"])],
    "attach": [("server_url", ["--server", "http://127.0.0.1:9"]), ("gpu", ["--gpu", "none"]), ("no_scrape", ["--no-scrape"]),
               ("duration", ["--duration", "1"]), ("listen", ["--listen", "127.0.0.1:0"]), ("capture_dir", ["--capture", "newcap"])],
    "compare": [("before", ["cap"]), ("after", ["cap2"])],
    "diagnose": [("capture", ["cap"])],
    "export": [("capture", ["cap"])],
    "import": [("fmt", ["llmperf"]), ("src", ["llmperf.json"]), ("out", ["-o", "newcap"])],
    "oncall": [("prometheus", ["--prometheus", "http://127.0.0.1:9"]), ("listen", ["--listen", "127.0.0.1:0"])],
    "plan": [("model", ["--model", "llama-3.1-8b"]), ("max_len", ["--max-len", "8192"]), ("gpu_mem", ["--gpu-mem", "H100"])],
    "quality": [("baseline", ["--baseline", "http://127.0.0.1:9"]), ("candidate", ["--candidate", "http://127.0.0.1:9"]),
                ("prompts_path", ["--prompts", "prompts.jsonl"])],
    "report": [("capture", ["cap"]), ("output", ["-o", "out.html"])],
    "rules list": [], "rules show": [("rule_id", ["prefill-bound"])], "rules test": [("only", ["--rule", "prefill-bound"])],
    "rules export": [("fmt", ["--format", "prometheus"])],
    "signals": [],
    "summary": [("capture", ["cap"])],
}
#: options that need another to mean anything: the base gains these (fleet mode: no CAPTURE, --prometheus)
NEEDS: dict[tuple[str, str], tuple[list[str], list[tuple[str, list[str]]]]] = {
    ("advise", "gpu_mem"): ([], [("model", ["--model", "llama-3.1-8b"])]),
}
FLEET_ONLY = ("selector", "gpu_selector", "sidecar_selector", "prom_start", "prom_end", "group_by", "bearer_token",
              "bearer_token_file", "basic_auth", "ca_file", "insecure", "prom_timeout", "prometheus")


def commands() -> dict[str, click.Command]:
    ctx = click.Context(cli)
    out = {}
    for name in sorted(COMMANDS):
        cmd = cli.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            out.update({f"{name} {sub}": c for sub, c in cmd.commands.items()})
        else:
            out[name] = cmd
    return out


def kind_values(param: click.Parameter) -> list[str] | None:
    """The bad values a parameter's type implies, or None when the type says nothing."""
    t = param.type
    if isinstance(param, click.Option) and param.is_flag:
        return []
    if isinstance(t, P.Duration):
        return ["-5", "1e400", "5 parsecs", BAD_UTF8, f"{t.max_s * 10:.0f}"] + ([] if t.zero_ok else ["0"])
    if isinstance(t, P.Size):
        return ["-1GiB", "5 parsecs", "1e30TiB", BAD_UTF8] + (["0"] if t.min_bytes > 0 else [])
    if isinstance(t, P.Time):
        return ["yesterday", "2026-13-45T00:00:00Z", BAD_UTF8]
    if isinstance(t, P.Count):
        return ["-3", "1e30", "2.5", "abc", str(t.hi + 1)] + (["0"] if t.lo > 0 else [])
    if isinstance(t, click.IntRange):
        return ["-3", "1e30", "abc"] + ([str(t.max + 1)] if t.max is not None else [])
    if isinstance(t, click.FloatRange):
        return ["-3", "1e30", "abc", "nan"]
    if isinstance(t, click.Choice):
        return ["nope", BAD_UTF8]
    if isinstance(t, P.Address):
        return ["host:port", "127.0.0.1:70000", BAD_UTF8]
    if isinstance(t, P.Url):
        return ["ftp://x", "not a url", "http://", BAD_UTF8]
    if isinstance(t, P.Engine):
        return ["nope", BAD_UTF8]
    if isinstance(t, P.Gpu):
        return ["Z9000", ""]
    if isinstance(t, P.Objective):
        return ["ttft_p99=-2s", "ttft_p99=2parsecs", "nope=1s", BAD_UTF8]
    if isinstance(t, P.Selector):
        return ["job=", "{job=vllm}"]
    if isinstance(t, P.Labels):
        return ["", "bad label!"]
    if isinstance(t, P.UserPass):
        return ["nocolon"]
    if isinstance(t, P.OutputFile):
        return ["existing_dir", "missing_dir/x.out", ""]
    if isinstance(t, P.OutputFolder):
        return ["existing.txt", "existing.txt/sub"]
    if isinstance(t, click.Path) and t.exists:
        return ["missing.file", BAD_UTF8]
    return None  # a plain string or path: DECLARED must say


def cases() -> list[tuple[str, str, str]]:
    out = []
    for cname, cmd in commands().items():
        for p in cmd.params:
            if p.name == "help":
                continue
            values = DECLARED.get((cname, p.name))
            if values is None:
                values = kind_values(p)
            if values is None:
                out.append((cname, p.name, "<undeclared>"))
                continue
            out += [(cname, p.name, v) for v in values + EXTRA.get((cname, p.name), [])]
    return out


CASES = cases()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    ws = tmp_path_factory.mktemp("ws")
    shutil.copytree(ROOT / "samples" / "prefix-cache-off", ws / "cap")
    shutil.copytree(ROOT / "samples" / "prefix-cache-on", ws / "cap2")
    shutil.copy(ROOT / "tests" / "data" / "traces" / "llmperf" / "anyscale_7b.json", ws / "llmperf.json")
    (ws / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    (ws / "existing_dir").mkdir()
    (ws / "existing_dir" / "kept.txt").write_text("kept\n")
    (ws / "existing.txt").write_text("kept\n")
    (ws / "empty.txt").write_text("")
    return ws


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(folder))] = (st.st_size if p.is_file() else -1, st.st_mtime_ns if p.is_file() else 0)
    return out


def invocation(cname: str, pname: str, value: str) -> list[str]:
    cmd = commands()[cname]
    param = next(p for p in cmd.params if p.name == pname)
    base = list(BASE[cname])
    if cname in ("diagnose", "report") and pname in FLEET_ONLY:
        base = [x for x in base if x[0] != "capture"] + FLEET  # fleet mode: --prometheus stands in for CAPTURE
    base += NEEDS.get((cname, pname), ([], []))[1]
    tokens = [value] if isinstance(param, click.Argument) else [next(o for o in param.opts if o.startswith("--")), value]
    if any(name == pname for name, _ in base):
        base = [(name, tokens if name == pname else toks) for name, toks in base]
    elif isinstance(param, click.Argument):  # an argument not in the base goes after the base's arguments
        arguments = {p.name for p in cmd.params if isinstance(p, click.Argument)}
        at = max((i + 1 for i, (n, _) in enumerate(base) if n in arguments), default=0)
        base.insert(at, (pname, tokens))
    else:
        base.append((pname, tokens))
    return [*cname.split(), *[t for _, toks in base for t in toks]]


class Hung(Exception):
    pass


def _alarm(signum, frame):
    raise Hung("the command ran on: the bad value was accepted")


def test_every_option_has_a_kind_of_bad_value():
    undeclared = [f"{c} {p}" for c, p, v in CASES if v == "<undeclared>"]
    assert not undeclared, ("these options take any string or path: declare their bad values in DECLARED "
                            f"(or give them a kvdoctor/cli/params.py type): {undeclared}")


def test_the_walk_covers_every_command():
    named = {c for c, _, _ in CASES}
    assert named >= {c for c in commands() if commands()[c].params and c not in ("rules list", "signals")} - {"signals"}
    assert len(CASES) > 300


@pytest.mark.parametrize("cname,pname,value", [c for c in CASES if c[2] != "<undeclared>"],
                         ids=lambda x: x.encode("ascii", "backslashreplace").decode()[:40] if isinstance(x, str) else x)
def test_a_bad_value_is_one_line_exit_2_and_changes_nothing(cname, pname, value, workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    args = invocation(cname, pname, value)
    before = snapshot(workspace)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        res = CliRunner().invoke(cli, args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    after = snapshot(workspace)
    assert not isinstance(res.exception, Hung), f"kvdoctor {' '.join(args)}: {res.exception}"
    assert res.exit_code == BAD_INPUT, (f"kvdoctor {' '.join(args)!r} exited {res.exit_code} "
                                        f"({EXIT_CODES.get(res.exit_code, '?')}):\n{res.output[-1500:]}")
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvdoctor: error: "), (args, res.stderr)
    assert "Traceback" not in res.output and "internal error" not in res.stderr
    param = next(p for p in commands()[cname].params if p.name == pname)
    if isinstance(param, click.Argument):  # the line names the value, or the argument
        said = [value.strip() or "''", value.encode("ascii", "backslashreplace").decode(), param.human_readable_name,
                param.name.upper()]
    else:
        said = [o for o in param.opts if o.startswith("--")]
    assert any(s in lines[0] for s in said), f"{lines[0]!r} names none of {said}"
    assert res.stdout == "", (args, res.stdout[:500])
    assert after == before, f"kvdoctor {' '.join(args)!r} changed the folder: " \
                            f"{sorted(set(after) ^ set(before)) or [k for k in after if after[k] != before.get(k)]}"
