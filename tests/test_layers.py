"""The shape of the tree (docs/architecture.md, "Rules of the tree"): imports run downward, httptools
only in the proxy's HTTP core, the product never imports the test harness (harness/, not shipped)
(the import-linter contracts in pyproject.toml, run here as CI runs them), and no package reaches
into another's private names."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvdoctor"


def _lint_imports() -> list[str]:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("lint-imports is not installed: `pip install -e '.[test]'` brings import-linter")
    return [exe]


def test_import_contracts_are_kept():
    """Every contract in pyproject.toml's [tool.importlinter]: the layers from the front ends down to
    the records (exhaustive: a new package must be placed), httptools only under collect/proxy/http,
    no import of the harness."""
    got = subprocess.run(_lint_imports() + ["--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stdout[-6000:] + got.stderr[-2000:]
    assert "0 broken" in got.stdout


def test_the_layers_contract_catches_an_upward_import(tmp_path):
    """The contract is not vacuous: the same tree with one upward import (signals importing a
    renderer) breaks it, and the message names that import."""
    tree = tmp_path / "tree"
    shutil.copytree(PACKAGE, tree / "kvdoctor", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", tree / "pyproject.toml")
    with open(tree / "kvdoctor" / "signals" / "host.py", "a") as f:
        f.write("\nfrom ..report import html  # upward, on purpose\n")
    got = subprocess.run(_lint_imports() + ["--no-cache", "--contract", "layers"], cwd=tree, capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    assert got.returncode == 1, got.stdout[-3000:] + got.stderr[-2000:]
    assert "kvdoctor.signals.host -> kvdoctor.report.html" in got.stdout


def test_the_product_may_not_import_the_harness(tmp_path):
    """The harness is a dev package beside kvdoctor/, not in the wheel: the same tree with one module
    importing it breaks the no-harness contract, and the message names that import."""
    tree = tmp_path / "tree"
    shutil.copytree(PACKAGE, tree / "kvdoctor", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", tree / "pyproject.toml")
    with open(tree / "kvdoctor" / "units.py", "a") as f:
        f.write("\nfrom harness import loadgen  # the harness, from the product, on purpose\n")
    got = subprocess.run(_lint_imports() + ["--no-cache", "--contract", "no-harness"], cwd=tree, capture_output=True,
                         text=True, timeout=300, check=False, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    assert got.returncode == 1, got.stdout[-3000:] + got.stderr[-2000:]
    assert "kvdoctor.units -> harness" in got.stdout


def _module(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return (".".join(parts[:-1]), True) if parts[-1] == "__init__" else (".".join(parts), False)


def _package_of(module: str) -> str:
    """The top-level package a module belongs to (kvdoctor.collect.proxy.http.server -> kvdoctor.collect);
    a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def private_imports_across_packages() -> list[str]:
    """``from X import _name`` where X is in another top-level package than the importer."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module, is_pkg = _module(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("kvdoctor"):
                continue
            for alias in node.names:
                name = alias.name
                private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
                if private and _package_of(f"{source}.{name}") != _package_of(module):
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name} from {source}")
    return out


#: known, to be removed by whoever owns the importer (then delete the line here)
PRIVATE_IMPORTS_LEFT: dict[str, set[str]] = {}


def test_no_private_name_is_imported_across_packages():
    found = private_imports_across_packages()
    left = [f for f in found if f.split(":")[2].split()[0] in PRIVATE_IMPORTS_LEFT.get(f.split(":")[0], ())]
    assert [f for f in found if f not in left] == [], "import a public name (through the package's __init__)"
    # every exception listed is still there (else it was fixed: drop it from the list)
    still = {(f.split(":")[0], f.split(":")[2].split()[0]) for f in left}
    assert still == {(p, n) for p, names in PRIVATE_IMPORTS_LEFT.items() for n in names}
