"""Property tests (issue 14, proof): whatever bytes reach the capture reader, an importer, the
Prometheus text parser, the rule loader or the OTLP decoder, the answer is a result or the
project's own located error, never another exception. Bounded: a few dozen examples each, no
per-example deadline (a shared CI machine), about a minute in all."""
from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvdoctor  # noqa: E402
from kvdoctor.errors import InputError, KvdoctorError, RuleError  # noqa: E402

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

#: JSON-ish values of the shapes the formats use, plus the odd ones (huge ints, NaN-like strings)
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10 ** 30), max_value=10 ** 30),
                    st.floats(allow_nan=False), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
REQUEST_KEYS = ["request_id", "arrival_s", "ttft_s", "e2e_s", "output_tokens", "prompt_tokens", "itl_s",
                "prefix_block_hashes", "status", "turn", "session_id", "error", "http_status"]
records = st.dictionaries(st.sampled_from(REQUEST_KEYS), values, max_size=6)
junk_lines = st.one_of(st.binary(max_size=60), records.map(lambda d: json.dumps(d).encode()),
                       records.map(lambda d: json.dumps(d).encode()[: len(json.dumps(d)) // 2]))


@FUZZ
@given(st.lists(junk_lines, min_size=1, max_size=8), st.booleans())
def test_capture_reader_reads_or_names_the_line(lines, torn_end):
    with tempfile.TemporaryDirectory() as d:
        cap = Path(d)
        (cap / "requests-000001.jsonl").write_bytes(b"\n".join(lines) + (b"" if torn_end else b"\n"))
        (cap / "events-000001.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        try:
            c = kvdoctor.load(cap)
        except InputError as e:
            assert "-000001.jsonl" in str(e) or "meta.json" in str(e)
            return
        assert len(c.requests) <= len(lines)


@FUZZ
@given(st.dictionaries(st.sampled_from(["format_version", "created_unix_s", "clock", "sources", "config",
                                        "text_stored", "engine", "extra"]), values, max_size=5))
def test_meta_json_loads_or_names_the_field(meta):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "meta.json").write_bytes(json.dumps({"format_version": 1, **meta}).encode())
        try:
            kvdoctor.load(d)
        except InputError as e:
            assert "meta.json" in str(e)


IMPORT_TEXT = st.one_of(
    st.text(max_size=300),
    st.lists(records.map(json.dumps), max_size=5).map("\n".join),
    st.lists(st.lists(st.text(alphabet=string.ascii_letters + string.digits + ".-", max_size=6), min_size=2,
                      max_size=4).map(",".join), min_size=1, max_size=5).map(lambda rows: "a,b,c\n" + "\n".join(rows)),
)


@pytest.mark.parametrize("fmt,suffix", [("vllm-bench", ".json"), ("llmperf", ".jsonl"), ("csv", ".csv"),
                                        ("mooncake", ".jsonl"), ("otlp-json", ".json"), ("prometheus", ".txt")])
def test_every_importer_imports_or_names_the_problem(fmt, suffix):
    from click.testing import CliRunner

    from kvdoctor.cli import cli

    @FUZZ
    @given(IMPORT_TEXT)
    def check(text):
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / f"in{suffix}"
            src.write_text(text)
            args = ["import", fmt, str(src), "-o", str(Path(d) / "cap")]
            if fmt == "csv":
                args += ["--col", "arrival_s=a", "--col", "ttft_s=b"]
            res = CliRunner().invoke(cli, args)
            assert res.exit_code in (0, 1, 2), (text, res.output, res.exception)
            assert "Traceback" not in res.output

    check()


PROM_LINES = st.one_of(
    st.text(max_size=80),
    st.builds(lambda n, l, v: f"{n}{{{l}}} {v}", st.sampled_from(["vllm:num_requests_running", "llamacpp:kv_cache_usage_ratio",
                                                                   "vllm:cache_config_info", "vllm:e2e_request_latency_seconds_bucket",
                                                                   "sglang:token_usage"]),
              st.sampled_from(['le="+Inf"', 'le="0.5"', 'num_gpu_blocks="123456789012345678901234"', 'model_name="m"',
                               'a="\\"', '']),
              st.one_of(st.floats().map(repr), st.sampled_from(["NaN", "+Inf", "-1e300", "x", "1e400"]))),
    st.sampled_from(["# TYPE vllm:num_requests_running gauge", "# TYPE vllm:e2e_request_latency_seconds histogram",
                     "# HELP x y", "# TYPE x bogus"]),
)


@FUZZ
@given(st.lists(PROM_LINES, max_size=12))
@example(['vllm:e2e_request_latency_seconds_bucket{model_name="m"} 0.0'])  # a bucket without le (found by this test)
def test_prometheus_text_parses_or_names_the_line(lines):
    from kvdoctor.engines import parse_scrape

    try:
        parse_scrape("\n".join(lines) + "\n", 0.0, "s")
    except InputError:
        pass


RULE_TEXT = st.one_of(
    st.text(max_size=200),
    st.builds(lambda when, rid: f"id: {rid}\ntitle: t\nseverity: warning\nsymptom:\n  name: s\n  when: {when}\n"
                                "causes: []\nevidence: []\nfixes: []\ntests: {{fire: [], no_fire: []}}\n",
              st.one_of(st.text(max_size=40), st.sampled_from(["ttft_p99_s > 1", "{all: [ttft_p99_s > 1]}", "[",
                                                                "&a [*a]", "{any: []}", "ttft_p99_s >"])),
              st.just("r")),
)


@FUZZ
@given(RULE_TEXT)
def test_rule_loader_loads_or_names_the_problem(text):
    from kvdoctor.diagnosis.rules import load_rule

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.yaml"
        path.write_text(text)
        try:
            load_rule(path)
        except RuleError as e:
            assert "r.yaml" in str(e)


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.builds(lambda v: json.dumps({"resourceSpans": v}).encode(), values)),
       st.sampled_from(["application/x-protobuf", "application/json"]), st.sampled_from(["identity", "gzip"]))
@example(b'{"resourceSpans": true}', "application/json", "identity")  # found by this test
@example(b'{"resourceSpans": [{"scopeSpans": 1}]}', "application/json", "identity")
def test_otlp_decoder_decodes_or_says_bad_request(body, content_type, encoding):
    from kvdoctor.collect import otlp_receiver as R

    try:
        msg = R._inflate_decode(body, encoding, content_type)
    except (R._BadRequest, R._TooLarge):
        return
    stats = {"spans": 0}
    R.records_from_request(msg, stats)


def test_the_errors_are_the_projects_own():
    assert issubclass(InputError, KvdoctorError) and issubclass(RuleError, KvdoctorError)
