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
