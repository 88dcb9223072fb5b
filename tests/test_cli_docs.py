"""docs/cli.md's exit-status table is generated from kvdoctor.errors.EXIT_CODES, and every
command's --help ends with the statuses it can return, made from the same table; the README's
import block can be pasted whole (each line writes its own capture); `rules test --format table`
and `rules show` tell an installed user where things are."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvdoctor.cli import COMMAND_EXITS, COMMANDS, cli, exit_codes_markdown, exit_epilog
from kvdoctor.errors import EXIT_CODES

ROOT = Path(__file__).resolve().parents[1]
GENERATED = re.compile(r"<!-- generated: exit statuses.*?-->\n(.*?)<!-- end generated -->", re.S)


def test_the_docs_table_is_the_generated_one():
    (block,) = GENERATED.findall((ROOT / "docs" / "cli.md").read_text())
    assert block == exit_codes_markdown(), ("docs/cli.md's exit-status table is out of date; replace the generated "
                                            "block with kvdoctor.cli.exit_codes_markdown():\n" + exit_codes_markdown())
    for code, meaning in EXIT_CODES.items():
        assert f"| {code} | {meaning} |" in block


def _commands():
    ctx = click.Context(cli)
    for name in sorted(COMMANDS):
        cmd = cli.get_command(ctx, name)
        yield name, cmd
        if isinstance(cmd, click.Group):
            for sub in cmd.commands:
                yield f"{name} {sub}", cmd.commands[sub]


@pytest.mark.parametrize("name", [n for n, _ in _commands()])
def test_every_help_ends_with_its_exit_statuses(name):
    res = CliRunner().invoke(cli, [*name.split(), "--help"])
    assert res.exit_code == 0, res.output
    flat = " ".join(res.stdout.split())
    assert " ".join(exit_epilog(name).replace("\b", "").split()) in flat
    for code in (0, 2, 70, *COMMAND_EXITS.get(name, ())):
        assert f" {code} {' '.join(EXIT_CODES[code].split())}" in flat, (name, code)
    assert flat.count("Exit status") == 1, "a hand-written exit status is left in the docstring"


def test_readme_import_block_pastes_whole(tmp_path):
    """Each line of the README's import block writes its own capture folder, so the block runs as
    pasted (as one script), in a folder holding the files it names (tests/test_docs.py DOC_INPUTS)."""
    from test_docs import ROOT as DOCS_ROOT, blocks, command_lines, doc_inputs, run_shell

    (block,) = [b for b in blocks(DOCS_ROOT / "README.md") if b.each_line and "kvdoctor import llmperf" in b.text]
    lines = command_lines(block.text)
    outs = [re.search(r"-o (\S+)", ln)[1] for ln in lines]
    assert len(set(outs)) == len(outs), f"two lines write the same capture: {outs}"
    folder = doc_inputs(tmp_path)
    got = run_shell(block.text, folder)
    assert got.returncode == 0, got.stderr[-2000:]
    for out in outs:
        assert (folder / out / "meta.json").is_file(), out


def test_rules_table_outside_a_checkout_says_it_needs_one(tmp_path, monkeypatch):
    """An installed package has the rules but not tests/labels.yaml and the captures it names."""
    import kvdoctor.diagnosis.rules as R

    installed = tmp_path / "site-packages" / "kvdoctor" / "_rules"
    shutil.copytree(ROOT / "rules", installed)
    monkeypatch.setattr(R, "builtin_rules_dir", lambda: installed)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["rules", "test", "--format", "table"])
    assert res.exit_code == 2, res.output
    (line,) = res.stderr.splitlines()
    assert "source checkout" in line and "--corpus FILE" in line
    show = CliRunner().invoke(cli, ["rules", "show", "prefill-bound"])
    assert show.exit_code == 0
    assert show.stdout.startswith(f"# shipped rule, installed at {installed / 'prefill-bound.yaml'}\n# to change it:")


def test_rules_table_from_a_checkout_folder_with_an_installed_package(tmp_path, monkeypatch):
    """`pip install .` then, in the checkout, `kvdoctor rules test --format table`: the corpus is
    found in the current folder (it used to be looked for inside site-packages)."""
    import kvdoctor.diagnosis.rules as R

    installed = tmp_path / "site-packages" / "kvdoctor" / "_rules"
    shutil.copytree(ROOT / "rules", installed)
    monkeypatch.setattr(R, "builtin_rules_dir", lambda: installed)
    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(cli, ["rules", "test", "--format", "json"])
    assert res.exit_code == 0, res.output[-2000:]
    assert '"rules"' in res.stdout or '"cases"' in res.stdout


def test_rules_show_in_a_checkout_names_its_rules_folder():
    res = CliRunner().invoke(cli, ["rules", "show", "prefill-bound"])
    assert res.exit_code == 0 and res.stdout.startswith(f"# shipped rule: {ROOT / 'rules' / 'prefill-bound.yaml'}")
