"""`kvdoctor rules list | show ID | test` and `kvdoctor signals`."""
from __future__ import annotations

import sys
from pathlib import Path

import click
import orjson

from ..errors import InputError

_rules_option = click.option("--rules", "rules_dirs", multiple=True,
                             type=click.Path(exists=True, file_okay=False, readable=True),
                             help="Extra folder of rule files (repeatable).")


def _load(rules_dirs):
    from ..diagnosis import load_rules

    return load_rules([Path(d) for d in rules_dirs])


@click.group("rules")
def command():
    """The rule catalog: symptom -> cause -> evidence -> fix, as data in rules/*.yaml.

    \b
    Examples:
      kvdoctor rules list
      kvdoctor rules show prefill-bound
      kvdoctor rules test                 # every rule's must-fire / must-not-fire captures
      kvdoctor rules test --rules my-rules/
      kvdoctor rules test --format table  # precision/recall per rule over tests/labels.yaml (a source checkout)
    """


@command.command("list")
@_rules_option
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def list_rules(rules_dirs, fmt):
    """One line per rule: id, severity, symptom, title."""
    rules = _load(rules_dirs)
    if fmt == "json":
        click.echo(orjson.dumps([{"id": r.id, "title": r.title, "severity": r.severity, "status": r.status, "symptom": r.symptom,
                                  "for_s": r.for_s, "path": str(r.path)} for r in rules], option=orjson.OPT_INDENT_2).decode())
        return
    width = max(len(r.id) for r in rules)
    for r in rules:
        click.echo(f"{r.id:<{width}}  {r.severity:<8}  {r.symptom:<11}  {r.title}{r.tag}")


@command.command("show")
@click.argument("rule_id")
@_rules_option
def show(rule_id, rules_dirs):
    """The rule file as written, with where it comes from. A shipped rule is read from the
    installed package: to change it, copy it into a folder of your own and pass --rules FOLDER
    (the same id replaces the shipped rule); edits inside the installed package are lost on
    the next upgrade."""
    from ..diagnosis.rules import builtin_rules_dir

    rules = {r.id: r for r in _load(rules_dirs)}
    if rule_id not in rules:
        raise InputError(f"no rule {rule_id!r}; `kvdoctor rules list` shows the ids")
    path = rules[rule_id].path
    shipped = path.resolve().parent == builtin_rules_dir().resolve()
    if not shipped:
        click.echo(f"# {path} (from --rules)")
    elif _in_site_packages(path):
        click.echo(f"# shipped rule, installed at {path}")
        click.echo("# to change it: copy it to a folder of your own, edit, and pass --rules FOLDER (same id replaces it)")
    else:
        click.echo(f"# shipped rule: {path} (this source checkout's rules/)")
    click.echo(path.read_text(encoding="utf-8"), nl=False)


def _in_site_packages(path: Path) -> bool:
    return any(part in ("site-packages", "dist-packages") for part in path.resolve().parts)


@command.command("test")
@_rules_option
@click.option("--rule", "only", multiple=True, help="Test only this rule id (repeatable).")
@click.option("-v", "--verbose", is_flag=True, help="Show every case, not only failures.")
@click.option("--format", "fmt", type=click.Choice(["cases", "table", "json"]), default=None,
              help="cases (default): each rule's must-fire/must-not-fire captures (exit 1 on a failure); "
                   "table/json: precision and recall per rule over the labelled corpus (table when --corpus is given).")
@click.option("--corpus", type=click.Path(exists=True, dir_okay=False, readable=True), default=None,
              help="Labelled corpus for table/json (default: tests/labels.yaml of the source checkout kvdoctor runs "
                   "from, or of the current folder; the corpus and the captures it names are not installed by pip).")
def test(rules_dirs, only, verbose, fmt, corpus):
    """Run every rule's must-fire and must-not-fire captures; exit 1 if any case fails.
    With --format table|json: how often each rule is right over a labelled corpus of real
    captures and public data (labels from the raw numbers: scripts/label-corpus)."""
    if fmt is None:
        fmt = "table" if corpus else "cases"  # a corpus given means the user wants it scored
    if fmt != "cases":
        return _corpus(_load(rules_dirs), fmt, corpus)
    if corpus:
        raise InputError("--corpus is scored with --format table or json; --format cases runs the rules' own captures")
    from ..diagnosis.selftest import run

    rules = _load(rules_dirs)
    unknown = sorted(set(only) - {r.id for r in rules})
    if unknown:
        raise InputError(f"--rule {unknown[0]}: no such rule; `kvdoctor rules list` shows the ids")
    results = run(rules, set(only) or None)
    failed = [r for r in results if not r.passed]
    for r in results:
        if verbose or not r.passed:
            mark = "ok  " if r.passed else "FAIL"
            want = "fire" if r.expect_fire else "no fire"
            click.echo(f"{mark} {r.rule}: {r.capture} (want {want}; {r.detail})")
    click.echo(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


def _corpus(rules, fmt: str, corpus: str | None) -> None:
    from ..diagnosis import corpus as K
    from ..diagnosis.rules import builtin_rules_dir
    from ..errors import InputError

    if corpus:
        path = Path(corpus)
    else:
        # the corpus names captures under samples/ and tests/data/ (8 MB): a source checkout has
        # them, an installed package does not; a checkout is found beside the rules or here
        found = [p for p in (builtin_rules_dir().parent / "tests" / "labels.yaml", Path.cwd() / "tests" / "labels.yaml")
                 if p.is_file()]
        if not found:
            raise InputError("no labelled corpus: --format table/json scores the rules over tests/labels.yaml and the "
                             "captures it names, which come with a source checkout (git clone), not with pip; run it "
                             "from a checkout's top folder or pass --corpus FILE")
        path = found[0]
    cases = K.read_corpus(path)
    scores = K.evaluate(cases, rules)
    if fmt == "json":
        click.echo(orjson.dumps(K.to_json(scores, cases), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(K.table(scores, cases), nl=False)


command.add_command(__import__(f"{__package__}.rules_export", fromlist=["x"]).export_command)  # kvdoctor rules export
