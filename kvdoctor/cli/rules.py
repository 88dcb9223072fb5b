"""`kvdoctor rules list | show ID | test` and `kvdoctor signals`."""
from __future__ import annotations

import sys
from pathlib import Path

import click
import orjson

from ..errors import InputError, KvdoctorError

_rules_option = click.option("--rules", "rules_dirs", multiple=True, type=click.Path(),
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
      kvdoctor rules test --format table  # precision/recall per rule over tests/labels.yaml
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
    """The rule file as written (with its path)."""
    rules = {r.id: r for r in _load(rules_dirs)}
    if rule_id not in rules:
        raise KvdoctorError(f"no rule {rule_id!r}; `kvdoctor rules list` shows the ids")
    click.echo(f"# {rules[rule_id].path}")
    click.echo(rules[rule_id].path.read_text(), nl=False)


@command.command("test")
@_rules_option
@click.option("--rule", "only", multiple=True, help="Test only this rule id (repeatable).")
@click.option("-v", "--verbose", is_flag=True, help="Show every case, not only failures.")
@click.option("--format", "fmt", type=click.Choice(["cases", "table", "json"]), default=None,
              help="cases (default): each rule's must-fire/must-not-fire captures (exit 1 on a failure); "
                   "table/json: precision and recall per rule over the labelled corpus (table when --corpus is given).")
@click.option("--corpus", type=click.Path(dir_okay=False), default=None,
              help="Labelled corpus for table/json (default: the repository's tests/labels.yaml).")
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

    results = run(_load(rules_dirs), set(only) or None)
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

    path = Path(corpus) if corpus else builtin_rules_dir().parent / "tests" / "labels.yaml"
    if not path.is_file():
        raise InputError(f"{path}: no labelled corpus here; pass --corpus FILE (see scripts/label-corpus)")
    cases = K.read_corpus(path)
    scores = K.evaluate(cases, rules)
    if fmt == "json":
        click.echo(orjson.dumps(K.to_json(scores, cases), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(K.table(scores, cases), nl=False)


command.add_command(__import__(f"{__package__}.rules_export", fromlist=["x"]).export_command)  # kvdoctor rules export
