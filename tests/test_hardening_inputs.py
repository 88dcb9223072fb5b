"""Hardening against hostile or malformed inputs (issue 14, points 8-11): rule files that are
YAML bombs or absurdly deep, a turn number of 1e8, meta.json with fields a newer writer added,
port-only addresses, negative counters, and the bearer token's scheme and sources."""
from __future__ import annotations

import subprocess
import sys
import time
import tracemalloc
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

import kvdoctor
from harness.llama_server import free_port
from kvdoctor.capture import CaptureWriter
from kvdoctor.cli import cli
from kvdoctor.sidecar.agent import host_port
from kvdoctor.diagnosis.rules import MAX_RULE_BYTES, load_rule
from kvdoctor.errors import InputError, RuleError
from kvdoctor.model import EngineSample, RequestRecord

ROOT = Path(__file__).resolve().parents[1]


def _one_line_error(res, code: int, *needles: str) -> None:
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    for n in needles:
        assert n in res.output, res.output


# -- 8. rule files ------------------------------------------------------------------------------
LAUGHS = "".join(f"{chr(97 + i)}: &{chr(97 + i)} [" + ",".join([f"*{chr(96 + i)}"] * 9) + "]\n" for i in range(1, 9))


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    """619 bytes that expand to 9^9 strings: refused from the node graph, before anything is built."""
    path = tmp_path / "lol.yaml"
    path.write_text('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + LAUGHS.replace("a: &a", "_: &_", 0))
    t0 = time.monotonic()
    with pytest.raises(RuleError, match=r"lol.yaml: line \d+: expands to more than \d+ values \(YAML aliases\)"):
        load_rule(path)
    assert time.monotonic() - t0 < 1.0


def test_a_self_referring_alias_and_deep_nesting_are_refused(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.write_text("id: loop\nx: &x [1, *x]\n")
    with pytest.raises(RuleError, match="nested deeper than 40 levels"):
        load_rule(loop)
    deep = tmp_path / "deep.yaml"
    deep.write_text("id: deep\nsymptom:\n  when: " + "{all: [" * 30 + "x > 1" + "]}" * 30 + "\n")
    with pytest.raises(RuleError, match=r"deep.yaml: line 3: nested deeper than 40 levels"):
        load_rule(deep)


def test_an_oversized_rule_file_is_refused_through_the_cli(tmp_path):
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "big.yaml").write_text("id: big\n# " + "x" * MAX_RULE_BYTES + "\n")
    res = CliRunner().invoke(cli, ["rules", "list", "--rules", str(rules)])
    _one_line_error(res, 3, "big.yaml", "a rule file is at most 256 KiB")


def test_every_builtin_rule_still_loads():
    from kvdoctor.diagnosis import load_rules

    assert len(load_rules()) == len(list((ROOT / "rules").glob("*.yaml")))


# -- 9. per-turn arrays bounded by what is present ---------------------------------------------------
def test_one_request_at_turn_1e8_does_not_allocate_per_turn_number(tmp_path):
    from kvdoctor.diagnosis import diagnose
    from kvdoctor.report import figures as F

    with CaptureWriter(tmp_path / "c") as w:
        for i in range(60):
            w.write(RequestRecord(request_id=str(i), arrival_s=float(i), ttft_s=0.1 + 0.01 * (i % 4), e2e_s=1.0,
                                  output_tokens=20, prompt_tokens=100 * (1 + i % 4), session_id=str(i // 4),
                                  turn=1 + i % 4))
        w.write(RequestRecord(request_id="far", arrival_s=61.0, ttft_s=0.1, e2e_s=1.0, output_tokens=20,
                              prompt_tokens=100, session_id="x", turn=100_000_000))
    d = diagnose(kvdoctor.load(tmp_path / "c"))
    prep = d.prepared or F.Prepared(d.capture, d.options.slo)
    tracemalloc.start()
    try:
        chart = F.turns_chart(d, prep)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100e6, f"peak {peak / 1e6:.0f} MB"
    assert chart.figure is not None and list(chart.figure.data[0].x) == [1, 2, 3, 4]


# -- 10. located errors instead of exit 70 --------------------------------------------------------
def _capture_with_meta(tmp_path: Path, edit) -> Path:
    with CaptureWriter(tmp_path / "c") as w:
        w.write(RequestRecord(request_id="a", arrival_s=1.0, ttft_s=0.1))
        w.source_status("scrape", True, "fine")
    meta = orjson.loads((tmp_path / "c" / "meta.json").read_bytes())
    edit(meta)
    (tmp_path / "c" / "meta.json").write_bytes(orjson.dumps(meta))
    return tmp_path / "c"


def test_unknown_fields_in_a_meta_sources_entry_are_ignored(tmp_path):
    cap = _capture_with_meta(tmp_path, lambda m: m["sources"]["scrape"].update(since_unix_s=5, extra={"x": 1}))
    meta = kvdoctor.load(cap).meta
    assert meta.sources["scrape"].ok is True and meta.sources["scrape"].detail == "fine"
    res = CliRunner().invoke(cli, ["summary", str(cap)])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m.update(config=[1, 2]), "field config: expected dict, got list"),
    (lambda m: m.update(created_unix_s="yesterday"), "field created_unix_s: expected int or float, got str"),
    (lambda m: m.update(sources=[1]), "field sources: expected an object"),
])
def test_wrong_types_in_meta_are_a_located_error(tmp_path, edit, needle):
    cap = _capture_with_meta(tmp_path, edit)
    res = CliRunner().invoke(cli, ["summary", str(cap)])
    _one_line_error(res, 2, "meta.json", needle)


def test_meta_json_that_is_not_an_object(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "meta.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="meta.json: expected a JSON object"):
        kvdoctor.load(tmp_path / "c")


@pytest.mark.parametrize("text,expected", [
    ("9000", ("127.0.0.1", 9000)), ("0.0.0.0:9000", ("0.0.0.0", 9000)), (":9000", ("127.0.0.1", 9000)),
    ("localhost", ("localhost", 4242)), ("[::1]:9000", ("::1", 9000)), ("[::1]", ("::1", 4242)),
])
def test_listen_addresses_port_only_included(text, expected):
    assert host_port(text, 4242) == expected


@pytest.mark.parametrize("bad", ["host:port", "127.0.0.1:70000", "[::1]x"])
def test_a_bad_listen_address_is_a_one_line_error(bad, tmp_path):
    res = CliRunner().invoke(cli, ["attach", "--server", "http://127.0.0.1:9", "--proxy", bad, "--gpu", "none",
                                   "--capture", str(tmp_path / "cap")])
    _one_line_error(res, 2, "--proxy", "expected HOST:PORT")


def test_attach_proxy_given_as_a_bare_port_listens_on_loopback(tmp_path):
    port, listen = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvdoctor", "attach", "--server", "http://127.0.0.1:9", "--gpu", "none",
                             "--no-scrape", "--proxy", str(port), "--listen", str(listen), "--capture",
                             str(tmp_path / "cap"), "--duration", "3"], stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert f"proxy listening on http://127.0.0.1:{port}" in err


def test_negative_counters_and_short_histogram_counts_are_fixed_with_a_warning(tmp_path):
    with CaptureWriter(tmp_path / "c") as w:
        w.write(EngineSample(time_s=1.0, engine="vllm", values={"prompt_tokens_total": -5.0, "kv_usage_frac": 0.5},
                             histograms={"ttft_seconds": {"le": [0.1, 1.0, float("inf")], "cum": [3, 2, 4],
                                                          "sum": 1.0, "count": 1}}))
    assert any("prompt_tokens_total" in x and "negative" in x for x in w.warnings)
    assert any("count 1 below" in x for x in w.warnings)
    cap = kvdoctor.load(tmp_path / "c")
    assert "prompt_tokens_total" not in cap.engine.values and cap.engine.values["kv_usage_frac"].tolist() == [0.5]
    h = cap.engine.histograms["ttft_seconds"][0][1]
    assert h["cum"] == [3, 3, 4] and h["count"] == 4


# -- 11. token ---------------------------------------------------------------------------------------
def _get(url, auth=None):
    req = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except urllib.error.URLError:
        return 0


def test_bearer_scheme_is_case_insensitive_and_the_token_comes_from_a_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    listen = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvdoctor", "attach", "--server", "http://127.0.0.1:9", "--gpu", "none",
                             "--no-scrape", "--listen", str(listen), "--token-file", str(token_file), "--capture",
                             str(tmp_path / "cap"), "--duration", "20"], stderr=subprocess.PIPE, text=True)
    try:
        api = f"http://127.0.0.1:{listen}"
        end = time.monotonic() + 15
        while _get(f"{api}/healthz") != 200 and time.monotonic() < end:
            time.sleep(0.1)
        assert _get(f"{api}/metrics", "Bearer s3cret-token") == 200
        assert _get(f"{api}/metrics", "bearer s3cret-token") == 200
        assert _get(f"{api}/metrics", "BEARER  s3cret-token") == 200
        assert _get(f"{api}/metrics", "Basic s3cret-token") == 401
        assert _get(f"{api}/metrics", "Bearer s3cret-tokeN") == 401
        assert _get(f"{api}/metrics") == 401
    finally:
        proc.terminate()
        proc.communicate(timeout=15)
    assert "s3cret-token" not in " ".join(proc.args[:-6])  # nothing secret on the command line


def test_an_unreadable_token_file_is_a_one_line_error(tmp_path):
    res = CliRunner().invoke(cli, ["attach", "--server", "http://127.0.0.1:9", "--gpu", "none",
                                   "--token-file", str(tmp_path / "missing"), "--capture", str(tmp_path / "cap")])
    _one_line_error(res, 2, "--token-file", "cannot read")


# -- 11. control characters never reach the terminal ------------------------------------------------
EVIL = "\x1b]0;pwned\x07m\x1b[31mred\x9b2J"


@pytest.mark.parametrize("cmd", [["summary"], ["diagnose"], ["diagnose", "--format", "markdown"]])
def test_control_characters_from_a_capture_are_stripped_from_text_output(tmp_path, cmd):
    from kvdoctor.model import CaptureMeta

    with CaptureWriter(tmp_path / "c", CaptureMeta(engine="vllm", model=EVIL, server=EVIL)) as w:
        for i in range(50):
            w.write(RequestRecord(request_id=f"{EVIL}{i}", arrival_s=float(i), ttft_s=0.1 + (3.0 if i % 2 else 0),
                                  e2e_s=4.0, output_tokens=20, model=EVIL, error=EVIL if i % 5 == 0 else None))
    res = CliRunner().invoke(cli, [*cmd, str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert "pwned" in res.output or "red" in res.output or len(res.output) > 50  # the data is there, defanged
    assert not any(c in res.output for c in "\x1b\x07\x9b")


def test_an_error_line_naming_hostile_bytes_is_defanged(tmp_path):
    src = tmp_path / "t\x07\x9b2Jrace.jsonl"  # click strips only ANSI colour sequences itself
    src.write_text("nope\n")
    res = CliRunner().invoke(cli, ["import", "mooncake", str(src), "-o", str(tmp_path / "cap")])
    assert res.exit_code == 2 and "\x07" not in res.output and "\x9b" not in res.output and "race.jsonl" in res.output


def test_markdown_output_escapes_what_comes_from_the_capture(tmp_path):
    from kvdoctor.model import CaptureMeta

    model = "evil](http://x.example/phish) <img src=x onerror=alert(1)> | **bold**"
    with CaptureWriter(tmp_path / "c", CaptureMeta(engine="vllm", model=model)) as w:
        for i in range(20):
            w.write(RequestRecord(request_id=str(i), arrival_s=float(i), ttft_s=0.1, e2e_s=1.0, output_tokens=10))
    res = CliRunner().invoke(cli, ["diagnose", "--format", "markdown", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if "phish" in x)
    import re

    value = line.split("model ", 1)[1]
    assert re.search(r"(?<!\\)[<>\[\]()|*]", value) is None, value  # every markup character escaped
    assert value.replace("\\", "") == model
