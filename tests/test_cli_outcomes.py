"""Issue 35 (the 3 a.m. read) and issue 31 point 1 through the command line: how a diagnosing
command ends (--fail-on: exit 7; nothing to diagnose: exit 6, the output printed first), time
ranges (inverted or in the future: exit 2; relative ones offline, against the capture's end),
the objective options reaching the diagnosis on every command that diagnoses, --format/-o on
summary/advise/plan, and the one parser per kind of value."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvdoctor
from kvdoctor.capture import CaptureWriter
from kvdoctor.cli import cli
from kvdoctor.cli import params as P
from kvdoctor.errors import EXIT_CODES, EXIT_FAIL_ON, InputError, NothingToDiagnose
from kvdoctor.model import CaptureMeta, Event

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"
RANK = {"info": 1, "warning": 2, "critical": 3}


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line(res) -> str:
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.output
    return lines[0]


def incidents_of(capture: Path) -> list[dict]:
    res = run("diagnose", capture, "--format", "json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["incidents"]


# -- --fail-on (exit 7) ------------------------------------------------------------------------------

@pytest.mark.parametrize("sample", ["multi-turn", "vllm-saturation", "healthy"])
@pytest.mark.parametrize("level", ["warning", "critical"])
def test_fail_on_exits_7_exactly_when_an_incident_reaches_the_level(sample, level, tmp_path):
    """The expectation comes from the capture's own diagnosis (diagnose --format json), so the
    test holds whichever verdicts the rules give: --fail-on only turns them into a status."""
    cap = SAMPLES / sample
    hit = any(RANK[i["severity"]] >= RANK[level] for i in incidents_of(cap))
    for cmd in (["diagnose", cap], ["summary", cap], ["report", cap, "-o", tmp_path / "r.html"]):
        res = run(*cmd, "--fail-on", level)
        assert res.stdout, "the result is printed before the exit status says anything"
        if hit:
            assert res.exit_code == EXIT_FAIL_ON == 7, res.output
            assert one_line(res).startswith(f"kvdoctor: --fail-on {level}: ")
        else:
            assert res.exit_code == 0 and res.stderr == "", res.output


def test_fail_on_in_compare_judges_after(tmp_path):
    off, on = SAMPLES / "prefix-cache-off", SAMPLES / "prefix-cache-on"
    assert incidents_of(off), "this pair is the fix that works: BEFORE has an incident"
    after_hit = any(RANK[i["severity"]] >= RANK["warning"] for i in incidents_of(on))
    res = run("compare", off, on, "--fail-on", "warning")
    assert res.exit_code == (7 if after_hit else 0) and res.stdout
    res = run("compare", on, off, "--fail-on", "warning")  # the fix undone: AFTER has the incident
    assert res.exit_code == 7 and "prefix-cache" in one_line(res)


def test_fail_on_is_documented_with_its_code():
    assert EXIT_CODES[7].startswith("an incident at or above --fail-on")
    for cmd in ("diagnose", "summary", "report", "compare"):
        assert "--fail-on [warning|critical]" in run(cmd, "--help").stdout


# -- nothing to diagnose (exit 6) ----------------------------------------------------------------------

@pytest.fixture()
def server_down(tmp_path) -> Path:
    """What attach leaves beside a server that never came up: meta.json and server-down events."""
    folder = tmp_path / "down"
    with CaptureWriter(folder, CaptureMeta(engine="vllm", origin="attach", server="http://127.0.0.1:8000")) as w:
        for t in (1_767_000_000.0, 1_767_000_060.0):
            w.write(Event(time_s=t, kind="server-down", server="http://127.0.0.1:8000",
                          detail={"error": "connection refused"}))
    assert not list(folder.glob("requests-*.jsonl"))
    return folder


@pytest.mark.parametrize("fmt", ["text", "markdown", "json"])
@pytest.mark.parametrize("cmd", ["diagnose", "summary"])
def test_a_server_down_throughout_is_exit_6_after_the_output(server_down, cmd, fmt):
    res = run(cmd, server_down, "--format", fmt)
    assert res.exit_code == NothingToDiagnose.exit_code == 6, res.output
    assert res.stdout, "the output comes first, as usual"
    line = one_line(res)
    assert line.startswith("kvdoctor: nothing to diagnose: ") and "down" in line
    if fmt == "json":
        doc = json.loads(res.stdout)
        assert doc["outcome"] == "nothing-to-diagnose" and "down" in doc["nothing_to_diagnose"]


def test_report_of_a_server_down_writes_the_page_then_exits_6(server_down, tmp_path):
    page = tmp_path / "r.html"
    res = run("report", server_down, "-o", page)
    assert res.exit_code == 6 and page.is_file() and "nothing to diagnose" in one_line(res)


def test_fail_on_does_not_hide_nothing_to_diagnose(server_down):
    assert run("diagnose", server_down, "--fail-on", "warning").exit_code == 6


@pytest.mark.parametrize("cmd", ["diagnose", "summary"])
def test_an_empty_range_is_nothing_to_diagnose(cmd):
    cap = SAMPLES / "multi-turn"
    whole = kvdoctor.load(cap)
    after_end = f"{whole.end_s + 3600:.0f}"  # an hour after the last record, before now
    res = run(cmd, cap, "--since", after_end)
    assert res.exit_code == 6, res.output
    assert "no requests and no samples in" in one_line(res)


def test_advise_on_an_empty_range_is_exit_6():
    cap = SAMPLES / "multi-turn"
    res = run("advise", cap, "--since", f"{kvdoctor.load(cap).end_s + 3600:.0f}")
    assert res.exit_code == 6 and "no request records in" in one_line(res)


# -- time ranges -----------------------------------------------------------------------------------

INVERTED = {
    "diagnose": ["diagnose", SAMPLES / "multi-turn"], "summary": ["summary", SAMPLES / "multi-turn"],
    "report": ["report", SAMPLES / "multi-turn", "-o", "r.html"], "export": ["export", SAMPLES / "multi-turn"],
    "advise": ["advise", SAMPLES / "multi-turn"],
}


@pytest.mark.parametrize("cmd", sorted(INVERTED))
@pytest.mark.parametrize("since,until", [("2026-11-30T10:38:00Z", "2026-11-30T10:37:30Z"), ("10s", "30s"), ("+40s", "+10s")])
def test_an_inverted_range_is_refused(cmd, since, until, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run(*INVERTED[cmd], "--since", since, "--until", until)
    assert res.exit_code == 2, res.output
    assert "is not before --until" in one_line(res) and res.stdout == ""
    assert not list(tmp_path.iterdir()), "nothing written"


@pytest.mark.parametrize("cmd", sorted(INVERTED))
def test_a_range_wholly_in_the_future_is_refused(cmd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run(*INVERTED[cmd], "--since", "2099-01-01T00:00:00Z")
    assert res.exit_code == 2 and "is in the future" in one_line(res), res.output


def test_compare_refuses_an_inverted_window():
    res = run("compare", f"{SAMPLES / 'multi-turn'}@+50..+10", SAMPLES / "multi-turn")
    assert res.exit_code == 2 and "ends before it starts" in one_line(res)


def test_relative_times_offline_count_from_the_capture_end_and_start():
    cap = SAMPLES / "multi-turn"
    whole = kvdoctor.load(cap)
    t = whole.requests.num("arrival_s")
    last_20s = int(((t >= whole.end_s - 20) & (t <= whole.end_s)).sum())
    first_20s = int(((t >= whole.start_s) & (t <= whole.start_s + 20)).sum())
    assert 0 < last_20s < len(t) and 0 < first_20s < len(t)
    for args, want in ((["--since", "20s"], last_20s), (["--until", "+20s"], first_20s),
                       (["--since", "20s", "--until", "now"], last_20s)):
        res = run("export", cap, "--format", "jsonl", *args)
        assert res.exit_code == 0, res.output
        assert len(res.stdout.splitlines()) == want, args


# -- objectives on every command that diagnoses --------------------------------------------------------

SLO_FILE = """\
workload: chat
slo:
  ttft_p99: 3s
models:
  smollm2:
    workload: interactive
    slo: {ttft_p99: 1s}
  other-model:
    slo: {ttft_p99: 9s}
"""


@pytest.fixture()
def slo_file(tmp_path) -> Path:
    p = tmp_path / "kvdoctor.yaml"
    p.write_text(SLO_FILE)
    return p


@pytest.fixture()
def model_capture(tmp_path) -> Path:
    """A capture of the model the SLO file names (vllm-preemption served SmolLM2 as "smollm2")."""
    cap = tmp_path / "smol"
    shutil.copytree(SAMPLES / "vllm-preemption", cap)
    meta = json.loads((cap / "meta.json").read_text())
    meta["model"] = "smollm2"
    (cap / "meta.json").write_text(json.dumps(meta))
    return cap


@pytest.fixture()
def seen_options(monkeypatch):
    """The Options each diagnosis is run with, and the capture it is run on."""
    import kvdoctor.diagnosis as D

    seen: list = []
    real = D.diagnose

    def spy(cap, rules=None, options=None, *a, **k):
        seen.append((cap, options))
        return real(cap, rules, options, *a, **k)

    monkeypatch.setattr(D, "diagnose", spy)
    return seen


def targets(options, model) -> dict[str, float]:
    return {o.signal: o.target for o in options.resolve(model).objectives}


@pytest.mark.parametrize("cmd", ["diagnose", "summary", "report"])
def test_slo_file_selects_the_capture_models_section(cmd, slo_file, model_capture, seen_options, tmp_path):
    extra = ["-o", tmp_path / "r.html"] if cmd == "report" else []
    res = run(cmd, model_capture, "--slo-file", slo_file, *extra)
    assert res.exit_code in (0, 6), res.output
    (cap, opts), = seen_options
    got = targets(opts, cap.meta.model)
    assert got["ttft_p99_s"] == 1.0  # models.smollm2 over the file's 3 s
    assert got["tpot_p99_s"] == 0.030  # its workload, interactive
    assert {o.source for o in opts.resolve(cap.meta.model).objectives if o.signal == "ttft_p99_s"} == {str(slo_file)}


def test_slo_file_default_section_for_another_model_and_slo_wins(slo_file, seen_options):
    res = run("diagnose", SAMPLES / "multi-turn", "--slo-file", slo_file, "--slo", "tpot_p99=80ms")
    assert res.exit_code == 0, res.output
    (cap, opts), = seen_options
    got = targets(opts, cap.meta.model)
    assert got["ttft_p99_s"] == 3.0 and got["tpot_p99_s"] == 0.080  # the file's default, then --slo


@pytest.mark.parametrize("workload,ttft", [("chat", 2.0), ("interactive", 0.5), ("batch", None)])
def test_workload_picks_the_default_objectives(workload, ttft, seen_options):
    res = run("summary", SAMPLES / "multi-turn", "--workload", workload)
    assert res.exit_code == 0, res.output
    (cap, opts), = seen_options
    assert targets(opts, cap.meta.model).get("ttft_p99_s") == ttft


def test_no_default_slo_judges_only_what_is_stated(seen_options):
    res = run("diagnose", SAMPLES / "multi-turn", "--no-default-slo", "--slo", "e2e_p90=5s")
    assert res.exit_code == 0, res.output
    (cap, opts), = seen_options
    assert targets(opts, cap.meta.model) == {"e2e_p90_s": 5.0}


def test_slo_help_names_the_defaults_and_the_switch():
    from kvdoctor.objectives import WORKLOADS

    text = " ".join(run("diagnose", "--help").stdout.split())
    assert "--no-default-slo turns the defaults off" in text
    assert "chat: TTFT P99 2 s, TPOT P99 100 ms, error rate 1%" in text and set(WORKLOADS) == {"chat", "interactive", "batch"}


def test_compare_passes_the_objectives(monkeypatch):
    import kvdoctor.compare as C

    seen = []
    real = C.compare

    def spy(before, after, rules=None, options=None, *a, **k):
        seen.append(options)
        return real(before, after, rules, options, *a, **k)

    monkeypatch.setattr(C, "compare", spy)
    res = run("compare", SAMPLES / "prefix-cache-off", SAMPLES / "prefix-cache-on", "--workload", "interactive",
              "--slo", "e2e_p99=10s")
    assert res.exit_code == 0, res.output
    assert targets(seen[0], None) == {"ttft_p99_s": 0.5, "tpot_p99_s": 0.030, "error_rate": 0.01, "e2e_p99_s": 10.0}


def test_attach_passes_the_objectives(monkeypatch, slo_file, tmp_path):
    import gc
    import sys

    import kvdoctor.sidecar.agent as A

    seen = []

    class Agent:
        def __init__(self, cfg):
            seen.append(cfg)

        async def run(self):
            return None

        def capture_problem(self):
            return None

    monkeypatch.setattr(A, "Agent", Agent)
    monkeypatch.setattr(A, "exit_promptly", lambda code, *a: (_ for _ in ()).throw(SystemExit(code)))
    monkeypatch.setattr("kvdoctor.cli.attach._limit_malloc_arenas", lambda: None)
    monkeypatch.setattr(gc, "freeze", lambda: None)
    monkeypatch.setattr(sys, "setswitchinterval", lambda s: None)
    res = run("attach", "--server", "http://127.0.0.1:9", "--gpu", "none", "--no-scrape", "--listen", "127.0.0.1:0",
              "--capture", tmp_path / "cap", "--slo-file", slo_file, "--no-default-slo", "--duration", "90s",
              "--max-capture-bytes", "512MiB", "--scrape-interval", "250ms")
    assert res.exit_code == 0, res.output
    cfg = seen[0]
    assert targets(cfg.options, "smollm2") == {"ttft_p99_s": 1.0}  # the file's model section, no defaults
    assert cfg.duration_s == 90.0 and cfg.max_capture_bytes == 512 << 20


def test_oncall_passes_the_objectives(monkeypatch):
    import asyncio

    import kvdoctor.oncall.diagnose as O

    seen = []
    real = O.Setup

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    monkeypatch.setattr(O, "Setup", spy)
    monkeypatch.setattr(asyncio, "run", lambda coro: coro.close())
    res = run("oncall", "--prometheus", "http://127.0.0.1:9", "--listen", "127.0.0.1:0", "--workload", "batch",
              "--slo", "itl_p99=200ms", "--before", "0", "--prom-timeout", "1.5")
    assert res.exit_code == 0, res.output
    s = seen[0]
    assert (s.workload, s.slo, s.default_objectives, s.before_s, s.timeout_s) == ("batch", {"itl_p99_s": 0.2}, True, 0.0, 1.5)


def _fleet_capture(folder: Path) -> Path:
    """A Prometheus range saved as a capture (`import prometheus-range`): two vLLM replicas, one queueing."""
    from kvdoctor.prometheus import FleetData
    from kvdoctor.prometheus.captures import meta_for, records
    from kvdoctor.model import EngineSample

    n = 40
    d = FleetData(0.0, (n - 1) * 10.0, 10.0, "test")
    for name, waiting in (("a:8000", 30.0), ("b:8000", 0.0)):
        d.samples[name] = [EngineSample(time_s=i * 10.0, engine="vllm", server=name,
                                        values={"requests_waiting": waiting, "requests_running": 4.0,
                                                "generation_tokens_total": 100.0 * i * 10.0}) for i in range(n)]
        d.engines[name] = "vllm"
    with CaptureWriter(folder, meta_for(d)) as w:
        for r in records(d):
            w.write(r)
    return folder


def test_fleet_mode_passes_the_objectives_and_fails_on(monkeypatch, tmp_path):
    import kvdoctor.fleet as F

    cap = _fleet_capture(tmp_path / "fleet")
    seen = []
    real = F.diagnose_fleet

    def spy(data, rules, options, *a, **k):
        seen.append(options)
        return real(data, rules, options, *a, **k)

    monkeypatch.setattr(F, "diagnose_fleet", spy)
    res = run("diagnose", "--prometheus", cap, "--step", "10s", "--format", "json", "--workload", "interactive")
    assert res.exit_code == 0, res.output
    assert targets(seen[0], None)["ttft_p99_s"] == 0.5
    found = [i for inst in json.loads(res.stdout)["instances"].values() for i in inst["incidents"]]
    worst = max((RANK[i["severity"]] for i in found), default=0)
    res = run("diagnose", "--prometheus", cap, "--step", "10s", "--fail-on", "warning")
    assert res.exit_code == (7 if worst >= RANK["warning"] else 0), res.output


def test_a_bad_slo_file_is_one_located_line_before_anything_is_read(tmp_path):
    bad = tmp_path / "kvdoctor.yaml"
    bad.write_text("slo:\n  ttft_p99: 2 parsecs\n")
    res = run("diagnose", "/nonexistent/capture", "--slo-file", bad)
    assert res.exit_code == 2 and f"{bad}: slo.ttft_p99" in one_line(res)


# -- --format and -o on summary, advise, plan -----------------------------------------------------------

def test_summary_json_is_diagnose_json():
    cap = SAMPLES / "multi-turn"
    a, b = run("summary", cap, "--format", "json"), run("diagnose", cap, "--format", "json")
    assert a.exit_code == b.exit_code == 0
    assert json.loads(a.stdout) == json.loads(b.stdout)


def test_summary_markdown_is_the_markdown_report():
    from kvdoctor.diagnosis import diagnose
    from kvdoctor.report.summary import markdown

    cap = SAMPLES / "multi-turn"
    res = run("summary", cap, "--format", "markdown")
    assert res.exit_code == 0 and res.stdout == markdown(diagnose(kvdoctor.load(cap)))


@pytest.mark.parametrize("args", [
    ["summary", SAMPLES / "multi-turn"],
    ["advise", SAMPLES / "long-prompts"],
    ["plan", "--model", "llama-3.1-8b", "--max-len", "8192", "--gpu-mem", "H100"],
])
@pytest.mark.parametrize("fmt", ["text", "markdown", "json"])
def test_format_and_output_file(args, fmt, tmp_path):
    out = tmp_path / f"out.{fmt}"
    printed = run(*args, "--format", fmt)
    written = run(*args, "--format", fmt, "-o", out)
    assert printed.exit_code == written.exit_code == 0, printed.output
    assert written.stdout == "" and out.read_text() == printed.stdout
    if fmt == "json":
        json.loads(printed.stdout)
    elif fmt == "markdown":
        assert printed.stdout.startswith("# ")


def test_plan_refuses_a_tp_degree_the_engines_refuse():
    res = run("plan", "--model", "llama-3.1-8b", "--max-len", "8192", "--gpu-mem", "H100", "--tp", "3")
    assert res.exit_code == 2 and "has 8 KV heads" in one_line(res)
    for tp in ("2", "4", "8"):  # divisors of its 8 KV heads and 32 attention heads
        assert run("plan", "--model", "llama-3.1-8b", "--max-len", "8192", "--gpu-mem", "H100", "--tp", tp).exit_code == 0


def test_plan_kv_mem_zero_names_kv_mem():
    res = run("plan", "--model", "llama-3.1-8b", "--max-len", "8192", "--kv-mem", "0GiB")
    assert res.exit_code == 2 and one_line(res).startswith("kvdoctor: error: --kv-mem ")


# -- one parser per kind of value ---------------------------------------------------------------------

@pytest.mark.parametrize("text,seconds", [("1.5", 1.5), ("90", 90.0), ("500ms", 0.5), ("30s", 30.0), ("5m", 300.0),
                                          ("2h", 7200.0), ("1d", 86400.0), (" 1e2 ", 100.0)])
def test_durations(text, seconds):
    from kvdoctor.timeparse import parse_seconds

    assert parse_seconds(text) == seconds == P.Duration().convert(text, None, None)


@pytest.mark.parametrize("text", ["-5", "5 parsecs", "nan", "inf", "1e400", "", "5mm", "m5"])
def test_bad_durations(text):
    from kvdoctor.timeparse import parse_seconds

    with pytest.raises(ValueError):
        parse_seconds(text)


@pytest.mark.parametrize("text,size", [("1GiB", 1 << 30), ("512MiB", 512 << 20), ("80GB", 80e9), ("1048576", 1 << 20),
                                       ("2G", 2 << 30), ("1.5KiB", 1536), ("10 kb", 10_000)])
def test_sizes(text, size):
    from kvdoctor.units import parse_size

    assert parse_size(text) == size == P.Size().convert(text, None, None)


@pytest.mark.parametrize("text", ["-1GiB", "1 parsec", "nan", "1e400GiB", "GiB", ""])
def test_bad_sizes(text):
    from kvdoctor.units import parse_size

    with pytest.raises(ValueError):
        parse_size(text)


def test_times():
    from kvdoctor.timeparse import parse_instant

    assert parse_instant("2026-11-30T08:00:00Z").resolve(None, 0) == 1_796_025_600.0
    assert parse_instant("1796025600").resolve(None, 0) == 1_796_025_600.0
    assert parse_instant("2h").resolve(100.0, 10_000.0) == 2_800.0  # before the end (a capture's, or now)
    assert parse_instant("+10m").resolve(100.0, 10_000.0) == 700.0  # after the start
    assert parse_instant("now").resolve(100.0, 10_000.0) == 10_000.0
    for bad in ("yesterday", "2026-13-45", "nan", "+x"):
        with pytest.raises(ValueError):
            parse_instant(bad)


def test_plan_sizes_use_the_one_parser():
    from kvdoctor.plan.models import parse_bytes

    assert parse_bytes("80GiB", "--x") == 80 << 30
    with pytest.raises(InputError, match="--x: '80' bytes is less than 1 MiB"):
        parse_bytes("80", "--x")


def test_attach_takes_durations_and_sizes_as_everywhere():
    text = " ".join(run("attach", "--help").stdout.split())
    for opt in ("--gpu-interval DURATION", "--scrape-interval DURATION", "--duration DURATION", "--max-capture-bytes SIZE",
                "--lookback DURATION", "--step DURATION"):
        assert opt in text, opt


def test_prom_timeout_default_is_one_value_everywhere():
    for cmd in ("diagnose", "report", "oncall"):
        assert f"[default: {P.PROM_TIMEOUT}]" in " ".join(run(cmd, "--help").stdout.split()).split("--prom-timeout")[1][:200]


def test_token_file_wherever_a_token_is():
    import click

    from kvdoctor.cli import COMMANDS

    ctx = click.Context(cli)
    checked = 0
    for name in COMMANDS:
        opts = {o for p in cli.get_command(ctx, name).params for o in p.opts}
        for token in ("--token", "--bearer-token"):
            if token in opts:
                assert f"{token}-file" in opts, f"kvdoctor {name} has {token} but no {token}-file"
                checked += 1
    assert checked >= 4  # attach, oncall (two), diagnose and report (fleet mode)
