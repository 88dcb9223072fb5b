"""A non-editable install must carry the rules, and only the product (not the test harness,
harness/): build the wheel, list it, install it apart, load rules."""
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
    # the product only: the test harness (harness/: server builders, scenarios, load generator) is a
    # dev package that runs from a checkout; nothing else lands at the top of site-packages
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"kvdoctor"}, \
        sorted({n.split("/")[0] for n in names})
    dev = [n for n in names if "harness" in n or "testing" in n]
    assert not dev, dev
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


# -- declared dependencies and extras ---------------------------------------------------------------
def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from pathlib import Path

    return tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())


def _dist_name(requirement: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group(0)).lower()


#: harness files that never run in the project's environment: the vLLM venv runs this one (torch,
#: transformers, safetensors come with vLLM there)
_RUN_ELSEWHERE = {"harness/gguf_to_safetensors.py"}


def third_party_imports(package_name: str = "kvdoctor") -> dict[str, set[str]]:
    """Every module outside the standard library, kvdoctor and the package itself that a package of
    the checkout imports: module -> the files that import it. ``kvdoctor`` is the shipped product;
    ``harness`` is the dev-only test harness (not in the wheel)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / package_name
    out: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        where = str(path.relative_to(package.parent))
        if where in _RUN_ELSEWHERE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in ("kvdoctor", package_name) and top not in sys.stdlib_module_names:
                    out.setdefault(name, set()).add(where)
    return out


def _providers(module: str) -> set[str]:
    """The installed distributions that hold ``module`` (in a namespace package such as
    ``opentelemetry``, only those with files under its path)."""
    import importlib.metadata as md

    top = module.split(".")[0]
    dists = set(md.packages_distributions().get(top, ()))
    if len(dists) > 1:
        path = module.replace(".", "/")
        dists = {d for d in dists if any(str(f).startswith((path + "/", path + ".")) for f in md.files(d) or ())}
    return {_dist_name(d) for d in dists}


def test_every_third_party_import_is_a_declared_dependency_or_extra():
    project = _pyproject()["project"]
    required = {_dist_name(r) for r in project["dependencies"]}
    extras = {name: {_dist_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()
              if name != "test"}
    declared = required | set().union(*extras.values())
    imports = third_party_imports()
    assert {"numpy", "httptools", "yarl", "grpc", "uvloop"} <= {m.split(".")[0] for m in imports}  # the scan sees them
    # the product never imports the test harness: the wheel does not carry it
    harness = {m: sorted(files) for m, files in imports.items() if m.split(".")[0] == "harness"}
    assert not harness, f"the product imports the harness: {harness}"
    missing = {m: sorted(files) for m in imports if not (_providers(m) & declared)
               for files in [imports[m]]}
    assert not missing, f"imported but not declared in pyproject.toml (a dependency or an extra): {missing}"
    # each extra's modules are imported only where its option runs, never at the top of a module
    # every command imports: the product works without them (test below)
    assert extras["grpc"] == {"grpcio"} and extras["uvloop"] == {"uvloop"}


def test_every_third_party_import_of_the_harness_is_a_test_dependency():
    """The harness (harness/, the dev-only package the tests, benchmarks and scripts import) needs
    only what `pip install -e '.[test]'` brings: the test extra, with the product's dependencies and
    the extras it names. A module only the harness needs goes into the test extra, not the product's
    dependencies."""
    import re

    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    declared = {_dist_name(r) for r in extras["test"]}
    for r in extras["test"]:  # kvdoctor[grpc,uvloop]: the product and those extras
        m = re.match(r"kvdoctor\[([\w,\s-]+)\]", r)
        if m:
            declared |= {_dist_name(d) for d in project["dependencies"]}
            declared |= {_dist_name(d) for name in m[1].split(",") for d in extras[name.strip()]}
    imports = third_party_imports("harness")
    assert {"aiohttp", "numpy"} <= {m.split(".")[0] for m in imports}  # the scan sees them
    missing = {m: sorted(files) for m in imports if not (_providers(m) & declared)
               for files in [imports[m]]}
    assert not missing, f"the harness imports these, not declared in pyproject.toml's test extra: {missing}"


#: the extras, blocked: what `pip install kvdoctor` without them leaves
_WITHOUT_EXTRAS = ("import sys, importlib.abc\n"
                   "class Block(importlib.abc.MetaPathFinder):\n"
                   "    def find_spec(self, name, path, target=None):\n"
                   "        if name.split('.')[0] in ('grpc', 'uvloop'):\n"
                   "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
                   "sys.meta_path.insert(0, Block())\n"
                   "from kvdoctor.cli import main\n"
                   "sys.argv[0] = 'kvdoctor'\n"
                   "main()\n")


def test_the_product_works_without_its_extras_and_says_which_one_an_option_needs(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def kvdoctor(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS, *args], capture_output=True, text=True,
                              cwd=root, timeout=120)

    got = kvdoctor("diagnose", "samples/multi-turn", "--format", "json")
    assert got.returncode == 0 and '"incidents"' in got.stdout, got.stderr[-2000:]
    # attach without uvloop runs on asyncio's loop
    got = kvdoctor("attach", "--server", "http://127.0.0.1:9", "--capture", str(tmp_path / "a"), "--listen", "127.0.0.1:0",
                   "--gpu", "none", "--no-scrape", "--duration", "1", "-q")
    assert got.returncode == 0, got.stderr[-2000:]
    # an option whose extra is missing: one line naming the extra, the input error's exit status, no traceback
    got = kvdoctor("attach", "--server", "http://127.0.0.1:9", "--capture", str(tmp_path / "b"), "--listen", "127.0.0.1:0",
                   "--gpu", "none", "--otlp-grpc-receiver", "127.0.0.1:0", "--duration", "1", "-q")
    assert got.returncode == 2, (got.returncode, got.stderr[-2000:])
    lines = [ln for ln in got.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "kvdoctor[grpc]" in lines[0] and "--otlp-grpc-receiver" in lines[0], got.stderr
    assert not (tmp_path / "b").exists()  # refused before a capture was started
