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
