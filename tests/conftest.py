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
