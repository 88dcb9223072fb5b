"""The docs stay true: every shell and Python block in README.md and docs/*.md runs here against
the shipped samples, and the output a block shows must still come out.

A block runs in a scratch folder holding links to samples/, rules/, docs/ and harness/ (the test
harness, a dev package run from the checkout root: ``python -m harness.loadgen``), a copy of one
sample as ``cap/`` (the name the docs use for "your capture") and a Hugging Face ``config.json``;
what a block writes (``-o report.html``, ``-o alerts/``) lands there. ``kvdoctor`` and ``python``
are this venv's, first on PATH. A block that cannot run here (a live server, a GPU, the network, a long install)
says so right above it, and the reason is shown in the test id and the skip message:

    <!-- docs-test: skip (needs a running server) -->

A block of alternatives (one import per input format, each writing ``cap/``) is marked

    <!-- docs-test: each-line -->

and each of its command lines runs on its own, in a fresh folder holding the input files the
docs name, played by the real files in tests/data (DOC_INPUTS). A block that needs a server
(``<!-- docs-test: llama-server -->``) runs with the server tests (``-m server``) beside a real
llama-server, whose address replaces ``http://127.0.0.1:PORT``. A synopsis (``kvdoctor compare
BEFORE AFTER [--format ...] ...``, not a command) is marked with the command it sums up

    <!-- docs-test: synopsis kvdoctor compare -->

and its options must be the ones that command's ``--help`` lists, in the same order.

Blocks with ``$ `` prompts show output: each shown line must appear in the command's output, in
order (whitespace collapsed; a line cut short with ``…`` or ``...`` matches up to the cut). On
``Evidence:`` and ``Impact:`` lines only the signal names are compared, not the measured values.
Separately, every ``--option`` written after ``kvdoctor SUBCOMMAND`` anywhere in the docs, run
or skipped, must be an option of that sub-command.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
CAP_SAMPLE = "aibrix-qps-4.1"  # the sample that plays `cap/`: 3.4 min of requests with arrival times
SHELL = {"bash", "sh", "console", "shell"}
MARKER = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>.+)\)\s*-->")
EACH_LINE = re.compile(r"<!--\s*docs-test:\s*each-line\s*-->")
LLAMA = re.compile(r"<!--\s*docs-test:\s*llama-server\s*-->")
SYNOPSIS = re.compile(r"<!--\s*docs-test:\s*synopsis\s+(?P<cmd>kvdoctor(?:\s+[\w-]+)+)\s*-->")
DATA = ROOT / "tests" / "data"
#: the input files that import examples name -> the real file in tests/data that plays it (see
#: tests/data/SOURCES.md); a ".jsonl" played by a pretty-printed ".json" is written as one line
DOC_INPUTS = {
    "results_individual_responses.json": "traces/llmperf/anyscale_7b.json",
    "bench-result.json": "vllm_bench/vllm-2.0qps-Llama-3.1-8B-Instruct-20250601-101500.json",
    "trace.csv": "traces/aibrix/naive_output_4.1.csv",
    "trace.jsonl": "traces/mooncake_conversation_trace_head2000.jsonl",
    "collector-export.jsonl": "otlp/vllm-0.32-llm_request-span.json",
    "artifacts/run/profile_export.jsonl": "traces/aiperf/profile_export.jsonl",
    "benchmarks.json": "traces/guidellm/benchmarks_stripped.json",
    "scrape-1.prom": "metrics/vllm-0.32-cpu-under-load.prom",
    "scrape-2.prom": "metrics/vllm-0.32-cpu-under-preemption.prom",
}
FENCE = re.compile(r"^(?P<fence>```+)\s*(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    skip: str | None  # the marker's reason, or None: the block runs
    each_line: bool = False  # alternatives: each command line runs on its own, on DOC_INPUTS
    llama: bool = False  # runs beside a real llama-server (server tests only)
    synopsis: str | None = None  # "kvdoctor compare": a synopsis of that command, checked against its --help

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str | None:
        """"shell", "python" or None (output, diagrams, YAML, JSON: not run)."""
        if self.lang in SHELL:
            return "shell"
        if self.lang == "python":
            return "python"
        first = self.text.lstrip().split("\n", 1)[0]
        if self.lang == "" and (first.startswith("$ ") or first.startswith("kvdoctor ")):
            return "shell"
        return None


def blocks(path: Path) -> list[Block]:
    out, lines, i = [], path.read_text().split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != m["fence"]:
            body.append(lines[i])
            i += 1
        prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        marker, synopsis = MARKER.search(prev), SYNOPSIS.search(prev)
        out.append(Block(path, start + 1, m["lang"], "\n".join(body), marker["reason"] if marker else None,
                         bool(EACH_LINE.search(prev)), bool(LLAMA.search(prev)),
                         " ".join(synopsis["cmd"].split()) if synopsis else None))
        i += 1
    return out


ALL = [b for p in DOCS for b in blocks(p)]
RUNNABLE = [b for b in ALL if b.kind and not b.llama and not b.synopsis]
SYNOPSES = [b for b in ALL if b.synopsis]
WITH_LLAMA = [b for b in ALL if b.kind and b.llama]


def _id(b: Block) -> str:
    return b.where + (f" [skip: {b.skip}]" if b.skip else "")


# ---------------------------------------------------------------- shown output


def console_steps(text: str) -> list[tuple[str, list[str]]]:
    """``$ cmd`` lines with the output lines shown after each; a block without prompts is one
    command (the whole text) with nothing shown."""
    if not any(ln.startswith("$ ") for ln in text.split("\n")):
        return [(text, [])]
    steps: list[tuple[str, list[str]]] = []
    for ln in text.split("\n"):
        if ln.startswith("$ "):
            steps.append((ln[2:], []))
        elif steps and ln.strip():
            steps[-1][1].append(ln)
    return steps


def _norm(s: str) -> str:
    return " ".join(s.split())


def _names(line: str) -> list[str]:
    """Signal names on an Evidence/Impact line: the words before each ` = `."""
    return re.findall(r"([\w.]+) = ", line)


def shown_line_found(shown: str, actual: str) -> bool:
    s, a = _norm(shown), _norm(actual)
    if s.startswith(("Evidence:", "Impact:")):
        return a.split(":", 1)[0] == s.split(":", 1)[0] and _names(s) == _names(a)
    for cut in ("…", "..."):
        if cut in s:
            return a.startswith(s.split(cut, 1)[0].rstrip())
    return s == a


def missing_lines(shown: list[str], output: str) -> list[str]:
    """Shown lines not found in the output, in order (each after the previous match)."""
    actual, at, missing = output.split("\n"), 0, []
    for s in shown:
        hit = next((j for j in range(at, len(actual)) if shown_line_found(s, actual[j])), None)
        if hit is None:
            missing.append(s)
        else:
            at = hit + 1
    return missing


# ---------------------------------------------------------------- running


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("docs")
    for name in ("samples", "rules", "docs", "harness"):
        (d / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "samples" / CAP_SAMPLE, d / "cap")
    shutil.copy(ROOT / "tests" / "data" / "hf_configs" / "gpt-oss-20b.json", d / "config.json")
    return d


def run_shell(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "120"}
    env.pop("KVDOCTOR_DEBUG", None)
    return subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def doc_inputs(into: Path) -> Path:
    """A folder holding the files the import examples name (DOC_INPUTS)."""
    import json

    for name, src in DOC_INPUTS.items():
        dst = into / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.suffix == ".jsonl" and src.endswith(".json"):
            dst.write_text(json.dumps(json.loads((DATA / src).read_text())) + "\n")
        else:
            shutil.copy(DATA / src, dst)
    return into


def command_lines(text: str) -> list[str]:
    """A block's commands: continuation lines joined, comment-only lines dropped."""
    out, joined = [], ""
    for ln in text.split("\n"):
        joined += ln.rstrip().rstrip("\\") + " " if ln.rstrip().endswith("\\") else ln
        if not ln.rstrip().endswith("\\"):
            if joined.strip() and not joined.lstrip().startswith("#"):
                out.append(joined.strip())
            joined = ""
    return out


@pytest.mark.parametrize("block", RUNNABLE, ids=_id)
def test_doc_block_runs(block: Block, scratch: Path, tmp_path: Path):
    if block.skip:
        pytest.skip(f"{block.where}: {block.skip}")
    if block.each_line:
        lines = command_lines(block.text)
        assert lines, f"{block.where}: marked each-line but holds no command"
        for k, cmd in enumerate(lines):
            got = run_shell(cmd, doc_inputs(tmp_path / f"line{k}"))
            assert got.returncode == 0, f"{block.where}: `{cmd}` exited {got.returncode}:\n{got.stderr[-2000:]}"
        return
    if block.kind == "python":
        steps = [(f"python - <<'PYTHON_DOC_BLOCK'\n{block.text}\nPYTHON_DOC_BLOCK", [])]
    else:
        steps = console_steps(block.text)
    run_steps(block, steps, scratch)


def run_steps(block: Block, steps: list[tuple[str, list[str]]], scratch: Path) -> None:
    for cmd, shown in steps:
        got = run_shell(cmd, scratch)
        assert got.returncode == 0, f"{block.where}: `{cmd}` exited {got.returncode}:\n{got.stderr[-2000:]}"
        missing = missing_lines(shown, got.stdout)
        assert not missing, (f"{block.where}: `{cmd}` no longer prints these shown lines (regenerate the "
                             f"block):\n" + "\n".join(missing) + f"\n--- it printed:\n{got.stdout[-3000:]}")


@pytest.fixture(scope="module")
def llama_url():
    from harness.llama_server import LlamaServer

    with LlamaServer(n_ctx=2048, parallel=2) as srv:
        yield srv.url


@pytest.mark.server
@pytest.mark.parametrize("block", WITH_LLAMA, ids=_id)
def test_doc_block_runs_beside_llama_server(block: Block, scratch: Path, llama_url: str):
    text = block.text.replace("http://127.0.0.1:PORT", llama_url)
    if block.kind == "python":
        steps = [(f"python - <<'PYTHON_DOC_BLOCK'\n{text}\nPYTHON_DOC_BLOCK", [])]
    else:
        steps = console_steps(text)
    run_steps(block, steps, scratch)


def test_every_runnable_block_is_run_or_marked():
    """A marker must sit on a block that would otherwise run: a stale marker on an output block
    hides nothing, and says so."""
    stray = [b.where for b in ALL if (b.skip or b.each_line or b.llama or b.synopsis) and not b.kind]
    assert not stray, f"docs-test markers on blocks that are not run anyway: {stray}"


def test_blocks_said_to_run_elsewhere_are_run_there():
    """A skip that says "runs as written in tests/X.py" (or "checked in tests/X.py") is a promise:
    X reads that doc's block."""
    said = [(b, m[1]) for b in ALL if b.skip
            for m in [re.search(r"(?:runs as written|checked) in (tests/[\w/]+\.py)", b.skip)] if m]
    assert said, "no block claims to run elsewhere (the README's attach examples do)"
    for b, test in said:
        assert b.path.name in (ROOT / test).read_text(), f"{b.where}: {test} does not read {b.path.name}"


def test_ci_runs_the_readme_test_block():
    """.ci/run is CI's entry point; the README says it runs exactly the README's test command.
    Its commands, past the shebang, `set` and `cd` to the checkout, must be that block's."""
    (block,) = [b for b in ALL if b.path.name == "README.md" and b.skip and ".ci/run" in b.skip]
    ci = [ln for ln in command_lines((ROOT / ".ci" / "run").read_text())
          if not ln.startswith(("set ", "cd "))]
    assert [ln.removeprefix("exec ") for ln in ci] == command_lines(block.text), \
        f"{block.where}: .ci/run runs {ci}, the README's test block says {command_lines(block.text)}"


def test_module_docstring_example_runs(scratch: Path):
    """The ``::`` example in kvdoctor/__init__.py's docstring is the first code a library user sees."""
    import kvdoctor

    example = kvdoctor.__doc__.split("::", 1)[1]
    code = "\n".join(ln[4:] for ln in example.split("\n"))
    got = run_shell(f"python - <<'PYTHON_DOC_BLOCK'\n{code}\nPYTHON_DOC_BLOCK", scratch)
    assert got.returncode == 0, got.stderr[-2000:]


# ---------------------------------------------------------------- synopses


def help_options(help_text: str) -> list[tuple[str, ...]]:
    """The options a click ``--help`` lists, in its order, each as its spellings (``-o, --output
    FILE`` -> ("-o", "--output")); --help itself left out. Option lines are indented two spaces,
    wrapped help text further (and may quote an option: "e.g. --slo ttft_p99=2s")."""
    opts = []
    for ln in help_text.split("\n"):
        m = re.match(r"  (-[\w-]+(?:, -[\w-]+)*)(?:\s|$)", ln)
        if m and "--help" not in m[1]:
            opts.append(tuple(m[1].split(", ")))
    return opts


def synopsis_options(text: str) -> list[str]:
    """Options a synopsis names, in order of first appearance (comments dropped)."""
    found: list[str] = []
    for ln in text.split("\n"):
        for opt in re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", ln.split(" #", 1)[0]):
            if opt not in found:
                found.append(opt)
    return found


@pytest.mark.parametrize("block", SYNOPSES, ids=_id)
def test_synopsis_matches_help(block: Block, scratch: Path):
    """A synopsis names every option of its command's --help, in the --help's order, so an option
    added, removed or moved in the code fails here until the synopsis follows."""
    words = block.text.split()
    assert " ".join(words[:len(block.synopsis.split())]) == block.synopsis, \
        f"{block.where}: marked as a synopsis of `{block.synopsis}` but begins `{' '.join(words[:3])}`"
    got = run_shell(f"{block.synopsis} --help", scratch)
    assert got.returncode == 0, f"{block.where}: `{block.synopsis} --help` exited {got.returncode}:\n{got.stderr[-2000:]}"
    want = help_options(got.stdout)
    assert want, f"{block.where}: no options found in `{block.synopsis} --help`:\n{got.stdout}"
    named = synopsis_options(block.text)
    unknown = [o for o in named if not any(o in spellings for spellings in want)]
    assert not unknown, f"{block.where}: the synopsis names {unknown}, which `{block.synopsis} --help` does not list"
    order = [next(s for s in want if o in s)[-1] for o in named]
    expected = [s[-1] for s in want]
    assert order == expected, (f"{block.where}: the synopsis' options differ from `{block.synopsis} --help` "
                               f"(missing: {[o for o in expected if o not in order]}; "
                               f"synopsis order {order}; --help order {expected})")


def test_help_options_reads_click_help():
    text = ("Options:\n  --format [text|json]  [default: text]\n  -o, --output FILE  Write here.\n"
            "  --slo NAME=VALUE   Objective, e.g. --slo ttft_p99=2s\n                     --slo error_rate=1%.\n"
            "  --sidecar-selector '{job=\"kvdoctor\"}'\n                     Fleet mode.\n"
            "  --insecure\n  -h, --help  Show this message and exit.\n")
    assert help_options(text) == [("--format",), ("-o", "--output"), ("--slo",), ("--sidecar-selector",), ("--insecure",)]
    assert synopsis_options("kvdoctor x A [-o FILE] [--slo N=V ...]   # --not-this\n   [--slo M=W] [--insecure]") == \
        ["-o", "--slo", "--insecure"]


# ---------------------------------------------------------------- options named in the docs


def _commands_in(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every `kvdoctor ...` command: in code blocks (continuation lines joined)
    and in inline code spans."""
    found, lines = [], path.read_text().split("\n")
    in_block, joined, joined_at = False, "", 0
    for n, ln in enumerate(lines, 1):
        if FENCE.match(ln) or ln.strip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            text = ln[2:] if ln.startswith("$ ") else ln
            if not joined:
                joined_at = n
            joined += " " + text.rstrip("\\").strip()
            if not ln.rstrip().endswith("\\"):
                found.append((joined_at, joined))
                joined = ""
        else:
            found += [(n, span) for span in re.findall(r"`([^`]+)`", ln)]
    return [(n, m) for n, text in found for m in re.findall(r"(?<![\w/.-])kvdoctor\s+[^#|;&]*", text)]


def _options() -> dict[tuple[str, ...], set[str]]:
    import click

    from kvdoctor.cli import COMMANDS, cli

    ctx, table = click.Context(cli), {}

    def walk(cmd, path):
        table[path] = {o for p in cmd.params for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}
        table[path] |= {"--help", "-h"}
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), (*path, name))

    for name in COMMANDS:
        walk(cli.get_command(ctx, name), (name,))
    return table


def test_documented_options_exist():
    table, wrong = _options(), []
    for path in DOCS:
        for line, cmd in _commands_in(path):
            words = cmd.split()[1:]
            key: tuple[str, ...] = ()
            for w in words:
                if (*key, w) in table:
                    key = (*key, w)
                else:
                    break
            if not key:
                continue  # prose ("kvdoctor attaches …"), not a command
            for opt in re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", " ".join(words[len(key):])):
                if opt.startswith("--") or len(opt) == 2:
                    if opt not in table[key]:
                        wrong.append(f"{path.relative_to(ROOT)}:{line}: kvdoctor {' '.join(key)} has no {opt}")
    assert not wrong, "\n".join(wrong)


def test_shown_outputs_are_regenerated():
    """Blocks marked ``<!-- docs-output: CMD -->`` show exactly what CMD prints now:
    scripts/make-docs rewrites them; this fails until it has been run after a change of output."""
    got = subprocess.run([sys.executable, str(ROOT / "scripts" / "make-docs"), "--check"], capture_output=True,
                         text=True, timeout=600)
    assert got.returncode == 0, got.stdout + got.stderr + "\nregenerate: scripts/make-docs"
