"""A non-editable install must carry the rules, and not the test harness: build the wheel, list it,
install it apart, load rules."""
import os
import subprocess
import sys
import zipfile

import pytest


@pytest.mark.slow
def test_wheel_ships_rules_and_schema(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), root],
                   check=True, capture_output=True)
    wheel = next(tmp_path.glob("kvdoctor-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvdoctor/_rules/prefill-bound.yaml" in names
    assert "kvdoctor/schema/rule.schema.json" in names
    # the test harness (server builders, scenarios, load generator) runs from a checkout only
    assert not [n for n in names if n.startswith("kvdoctor/testing/")], [n for n in names if "testing" in n]
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    code = ("import kvdoctor, sys; from kvdoctor.diagnosis.rules import builtin_rules_dir, load_rules; "
            "d = builtin_rules_dir(); assert str(d).startswith(sys.argv[1]), d; print(len(load_rules()))")
    out = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 15


@pytest.mark.slow
def test_readme_try_it_block_runs_as_written(tmp_path):
    """README.md's "Try it" line, as a new user runs it in a fresh checkout (the tracked files
    copied to a temp folder; pip's own cache as it is): a new venv, a non-editable install, then
    the summary of samples/prefix-cache-off, whose verdict must be the one this venv's kvdoctor gives."""
    import re
    import shutil
    from pathlib import Path

    from conftest import doc_blocks_for

    root = Path(__file__).resolve().parents[1]
    (block,) = doc_blocks_for("README.md", "tests/test_packaging.py")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True).stdout
    checkout = tmp_path / "kvdoctor"
    for name in filter(None, files.split("\0")):
        if (root / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, checkout / name)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "KVDOCTOR_DEBUG")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(os.path.dirname(sys.executable)))  # python3: the system's
    got = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=checkout, env=env, capture_output=True,
                         text=True, timeout=900)
    assert got.returncode == 0, f"README.md's Try it block exited {got.returncode}:\n{got.stderr[-3000:]}"
    assert not list((checkout / ".venv" / "lib").glob("python*/site-packages/__editable__*")), "installed editable"
    mine = subprocess.run([sys.executable, "-m", "kvdoctor", "summary", str(root / "samples" / "prefix-cache-off")],
                          capture_output=True, text=True, check=True).stdout

    def top_cause(text):  # the verdict line names the cause's rule: "(prefix-cache-ineffective, 80%)"
        m = re.search(r"likely cause: .*\(([\w-]+), \d+%\)$", text.splitlines()[0])
        assert m, text[-2000:]
        return m[1]

    assert top_cause(got.stdout) == top_cause(mine) == "prefix-cache-ineffective"
