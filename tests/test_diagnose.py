"""`kvdoctor diagnose` / `summary` as a user runs them, on the rule cases and real samples."""
import json

import pytest

import kvdoctor
from kvdoctor.diagnosis import Options, diagnose
from kvdoctor.objectives import parse_slo
from kvdoctor.errors import InputError

from conftest import CASES, ROOT


def test_json_schema_is_stable(run_cli):
    r = run_cli("diagnose", CASES / "multi-turn", "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["capture"]) >= {"requests", "start", "end", "sources"}
    assert out["capture"]["requests"] == 400
    inc = out["incidents"][0]
    assert set(inc) >= {"start", "end", "impact", "causes"}
    top = inc["causes"][0]
    assert top["rule"] == "kv-growth-per-turn"
    assert set(top) >= {"rule", "confidence", "evidence", "fixes"}
    assert top["evidence"]["turn_max"]["value"] == 10
    assert top["evidence"]["context_tokens_per_turn"]["unit"] == "tokens/turn"
    # causes ranked best first
    confs = [c["confidence"] for c in inc["causes"]]
    assert confs == sorted(confs, reverse=True)


def test_healthy_has_no_incident(run_cli):
    r = run_cli("summary", CASES / "healthy")
    assert r.returncode == 0
    first = r.stdout.splitlines()[0]
    assert first.startswith("OK: no objective broken") and "TTFT P99" in first and "objective 2 s" in first


@pytest.mark.parametrize("case,rule", [
    ("long-prompts", "prefill-bound"), ("multi-turn", "kv-growth-per-turn"), ("queueing", "queueing-saturation"),
    ("prefix-cache-off", "prefix-cache-ineffective"), ("leak", "gpu-memory-leak"), ("kv-quant", "kv-quant-quality"),
])
def test_expected_rule_is_top_cause_of_an_incident(case, rule):
    diag = diagnose(kvdoctor.load(CASES / case))
    assert rule in [inc.causes[0].rule.id for inc in diag.incidents]


def test_summary_is_short_and_names_cause_and_fix(run_cli):
    r = run_cli("summary", CASES / "long-prompts")
    assert r.returncode == 0
    blocks = [b for b in r.stdout.split("\n\n") if b.startswith("[")]  # one block per incident
    assert blocks, r.stdout
    for block in blocks:
        assert len(block.strip().splitlines()) <= 15
    first = blocks[0]
    assert "Likely cause" in first and "prefill-bound" in first and "First fix" in first
    assert "llama.cpp:" in first  # the capture's engine picks the knob shown


def test_markdown_and_text_formats(run_cli, tmp_path):
    md = run_cli("diagnose", CASES / "multi-turn", "--format", "markdown", "-o", tmp_path / "d.md")
    assert md.returncode == 0
    text = (tmp_path / "d.md").read_text()
    assert text.startswith("# kvdoctor diagnosis") and "| rank | rule |" in text
    full = run_cli("diagnose", CASES / "queueing")
    assert "Incident 1" in full.stdout and "fix:" in full.stdout
    observed = run_cli("diagnose", CASES / "multi-turn")  # growth per turn that hurts nobody yet
    assert "Observation 1" in observed.stdout and "fix:" in observed.stdout


def test_slo_adds_absolute_check():
    cap = kvdoctor.load(CASES / "healthy")
    assert diagnose(cap).incidents == []
    strict = diagnose(cap, options=Options(slo=parse_slo(["ttft_p99=10ms"])))
    ttft = [inc for inc in strict.incidents if inc.symptom == "ttft"]
    assert ttft, "a TTFT SLO far below the measured P99 must open an incident"
    assert ttft[0].impact["slo"] == 0.01 and ttft[0].impact["value"] > 0.01


def test_parse_slo_units():
    assert parse_slo(["ttft_p99=2s", "tpot_p99=80ms", "error_rate=1%"]) == {
        "ttft_p99_s": 2.0, "tpot_p99_s": 0.08, "error_rate": 0.01}
    with pytest.raises(InputError, match="expected NAME=VALUE"):
        parse_slo(["ttft_p99>2"])
    with pytest.raises(InputError, match="no objective 'latency'"):
        parse_slo(["latency=2s"])


def test_since_until_restricts_window(run_cli):
    full = json.loads(run_cli("diagnose", CASES / "healthy", "--format", "json").stdout)
    start = full["capture"]["start_s"]
    part = json.loads(run_cli("diagnose", CASES / "healthy", "--format", "json",
                              "--since", start + 100, "--until", start + 200).stdout)
    assert 0 < part["capture"]["requests"] < full["capture"]["requests"]


@pytest.mark.parametrize("args,needle", [
    (["diagnose", "/nonexistent/cap"], "no such capture"),
    (["diagnose", str(ROOT / "pyproject.toml")], "a capture is a folder"),
    (["diagnose", str(CASES / "healthy"), "--slo", "bogus"], "expected NAME=VALUE"),
    (["diagnose", str(CASES / "healthy"), "--since", "yesterday"], "expected epoch seconds or an ISO time"),
])
def test_bad_input_is_one_line_exit_2(run_cli, args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_library_use_without_cli():
    cap = kvdoctor.load(CASES / "queueing")
    result = diagnose(cap)
    data = result.to_json()
    assert data["incidents"][0]["causes"][0]["rule"] == "queueing-saturation"


def test_every_command_module_is_registered():
    """A module in kvdoctor/cli with a click `command` must be reachable from the CLI."""
    import importlib
    import pkgutil

    import click

    import kvdoctor.cli as cli

    for mod in pkgutil.iter_modules(cli.__path__):
        module = importlib.import_module(f"kvdoctor.cli.{mod.name}")
        if isinstance(getattr(module, "command", None), click.Command):
            assert module.command.name in cli.COMMANDS and cli.COMMANDS[module.command.name] == mod.name
