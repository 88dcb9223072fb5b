import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "rulecases"


@pytest.fixture
def run_cli():
    """Run the installed `kvdoctor` console script as a user would; returns CompletedProcess."""
    exe = shutil.which("kvdoctor") or str(Path(sys.executable).parent / "kvdoctor")

    def run(*args, check=False, env_extra=None, **kw):
        env = {**os.environ, "COLUMNS": "120", **(env_extra or {})}
        env.pop("KVDOCTOR_DEBUG", None)
        return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, check=check, env=env, **kw)

    return run


# ---------------------------------------------------------------- time per test file
# scripts/test prints its setup stages; this prints each test file's share of the run (setup,
# call and teardown, module fixtures such as a real server included), so a slow or stuck group
# is visible in CI's log.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _FILE_SECONDS:
        return
    terminalreporter.section("time per test file")
    for path, secs in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{secs:8.1f} s  {path}")


def request_records(cap) -> list:
    """A capture's requests as RequestRecords, to re-stamp and rebuild with from_records."""
    from kvdoctor.model import RequestRecord

    rows = cap.requests.table.to_pylist()
    return [RequestRecord(**{k: v for k, v in r.items() if v is not None}) for r in rows]


def assert_process_ends(pid: int, within_s: float = 5.0, what: str = "process") -> None:
    """``pid`` exits (or is left a zombie for its parent to reap) within ``within_s``."""
    import time

    import psutil

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    raise AssertionError(f"the {what} {pid} is still running after {within_s:.0f} s")


def assert_runs_below_us(pid: int) -> None:
    """The sidecar's analysis process ``pid`` runs at WORKER_NICENESS below this process."""
    from kvdoctor.workers import WORKER_NICENESS

    if not hasattr(os, "getpriority"):
        pytest.skip("process niceness is POSIX")
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICENESS, 19)


def poll(check, timeout_s: float = 30.0, what: str = "condition", every_s: float = 0.25):
    """Wait until ``check()`` returns something truthy and return it; fail naming ``what``.
    Tests on real servers wait for a state, never for a fixed time: a busy machine is slower."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = check()
        except Exception:  # noqa: BLE001 - not ready yet (connection refused, file absent, ...)
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


@pytest.fixture
def wait_for():
    return poll


# ---------------------------------------------------------------- doc blocks run by other test files


def doc_blocks_for(doc: str, test_file: str) -> list[str]:
    """The fenced blocks of ``doc`` (relative to the repo) whose docs-test skip marker says they
    run as written in ``test_file`` (tests/test_docs.py checks that promise is kept)."""
    import re

    pattern = (r"<!-- docs-test: skip \([^\n]*?runs as written in " + re.escape(test_file)
               + r"[^\n]*?\) -->\n```[\w-]*\n(.*?)```")
    return re.findall(pattern, (ROOT / doc).read_text(), re.S)


def run_get_then_collect_block(block: str, where: str) -> str:
    """docs/test-harness.md's `scripts/get-*` + `pytest -m server tests/...` blocks: the get line
    runs as written (``.venv/bin/python`` is this interpreter: with the build cached it only prints
    paths, which must exist); the pytest line runs with ``--collect-only`` appended (the suite is
    not re-run inside itself) and must select at least one test. Returns the get line's output."""
    import re
    import shlex

    lines = [ln.split("#", 1)[0].strip() for ln in block.strip().split("\n")]
    lines = [ln for ln in lines if ln]
    assert len(lines) == 2 and "scripts/get-" in lines[0] and " -m pytest " in lines[1], f"{where}: {lines}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    got = []
    for k, line in enumerate(lines):
        cmd = shlex.split(line)
        assert cmd[0] == ".venv/bin/python", f"{where}: `{line}` does not start with .venv/bin/python"
        cmd = [sys.executable, *cmd[1:], *(["--collect-only", "-p", "no:cacheprovider"] if k else [])]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{where}: `{line}` exited {r.returncode}:\n{r.stdout[-1500:]}{r.stderr[-1500:]}"
        got.append(r.stdout)
    paths = re.findall(r"^[\w -]+: (/\S+)$", got[0], re.M)
    assert len(paths) == 2 and all(Path(p).exists() for p in paths), f"{where}: `{lines[0]}` printed:\n{got[0]}"
    n = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", got[1])
    assert n and int(n[1]) > 0, f"{where}: `{lines[1]}` selects no test:\n{got[1][-1500:]}"
    return got[0]


def cause_tops(diag) -> list[str]:
    """Each incident's (and observation's) leading *cause*: its first cause that is not an
    objective rule (objective-* say a service-level objective is broken: harm, not why)."""
    out = []
    for inc in diag.incidents:
        causes = [c for c in inc.causes if c.rule.kind != "objective"]
        if causes:
            out.append(causes[0].rule.id)
    return out


def causes_fired(diag) -> set[str]:
    """Every cause rule that fired, objective rules left out."""
    return {c.rule.id for inc in diag.incidents for c in inc.causes if c.rule.kind != "objective"}


def pages(diag) -> list:
    """The incidents that page (warning or critical); observations (info) left out."""
    return [i for i in diag.incidents if not i.observation]
