"""Issue 14 point 10, through the command line as a user runs it: every importer, fed malformed
files (wrong JSON shapes, binary, truncation, 5,000-deep nesting, other formats' files) and
well-formed files with hostile values (negative, 1e308, 2^64-1 hash ids, NaN/inf, escape bytes),
answers with one located line and a stable exit code, never "internal error" (exit 70); what it
does import, diagnose, summary and report read without a crash."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli

EXIT_INTERNAL = 70

#: malformed: no importer may accept them, each must say which file and what it expected
MALFORMED = {
    "empty": b"", "binary": bytes(range(256)), "json-int": b"42", "json-list-of-ints": b"[1,2,3]",
    "json-str": b'"x"', "json-null": b"null", "truncated": b'{"a": [1, 2', "nan-literal": b'{"ttft": NaN}',
    "jsonl-mixed-shapes": b'{"a":1}\n[1]\n"s"\n', "csv-header-only": b"a,b,c\n",
    "csv-text-values": b"ttft,launch_time\nabc,def\n", "deep": b"[" * 5000 + b"]" * 5000,
    "vllm-bench-wrong-types": json.dumps({"ttfts": "x", "itls": 5, "input_lens": None, "output_lens": [1],
                                          "date": 3}).encode(),
    "otlp-wrong-types": json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"name": "llm_request", "startTimeUnixNano": "abc", "attributes": [{"key": 1}]}]}]}]}).encode(),
    "mooncake-wrong-types": b'{"timestamp": "x", "input_length": -1, "output_length": null, "hash_ids": "abc"}\n',
    "aiperf-wrong-types": b'{"metadata": 5, "metrics": {"ttft": {"value": "x", "unit": "parsecs"}}}\n',
    "guidellm-wrong-types": json.dumps({"benchmarks": [{"requests": {"successful": [
        {"start_time": "x", "prompt_tokens": -1}]}}]}).encode(),
    "prometheus-bad-sample": b'vllm:num_requests_running{a="b"} abc\n# TYPE x histogram\nx_bucket{le="x"} 1\n',
}
#: well-formed for one format, with values no real run has
HOSTILE = {
    "csv": b"ttft,launch_time\n-1,0\n1e308,1\n0,1e12\n,\nnan,inf\n",
    "llmperf": json.dumps([
        {"ttft_s": 1e308, "end_to_end_latency_s": -1, "inter_token_latency_s": 0, "number_input_tokens": 10 ** 20,
         "number_output_tokens": 0, "error_code": None},
        {"ttft_s": 0, "end_to_end_latency_s": 0, "inter_token_latency_s": 0, "number_input_tokens": 0,
         "number_output_tokens": 0, "error_code": 429, "error_msg": "\x1b[31mboom"}]).encode(),
    "mooncake": b'{"timestamp": 0, "input_length": 0, "output_length": 0, "hash_ids": []}\n'
                b'{"timestamp": 1e15, "input_length": 1e12, "output_length": -5, '
                b'"hash_ids": [18446744073709551615, -1]}\n',
}
FORMATS = {"vllm-bench": ".json", "llmperf": ".json", "csv": ".csv", "mooncake": ".jsonl", "otlp-json": ".jsonl",
           "prometheus": ".prom", "aiperf": ".jsonl", "guidellm": ".json"}
CSV_COLUMNS = ["--col", "ttft_s=ttft", "--col", "arrival_s=launch_time"]


def _run(*args: str):
    return CliRunner().invoke(cli, list(args))


def _one_located_line(result, where: str) -> None:
    assert result.exit_code != EXIT_INTERNAL, result.output
    assert not result.exception or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvdoctor: error: ") and where in lines[0], result.output
    assert "\x1b" not in result.output


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_malformed_files_get_one_located_line(fmt, tmp_path):
    for name, data in MALFORMED.items():
        src = tmp_path / f"{name}{FORMATS[fmt]}"
        src.write_bytes(data)
        r = _run("import", fmt, str(src), "-o", str(tmp_path / f"cap-{name}"), *(CSV_COLUMNS if fmt == "csv" else []))
        assert r.exit_code != 0, f"{fmt} accepted {name}: {r.output}"
        _one_located_line(r, src.name)


@pytest.mark.parametrize("fmt", sorted(HOSTILE))
def test_hostile_values_import_and_every_command_reads_them(fmt, tmp_path):
    src = tmp_path / f"hostile{FORMATS[fmt]}"
    src.write_bytes(HOSTILE[fmt])
    cap = tmp_path / "cap"
    r = _run("import", fmt, str(src), "-o", str(cap), *(CSV_COLUMNS if fmt == "csv" else []))
    if r.exit_code:  # refusing a value is fine, if said on one located line
        _one_located_line(r, src.name)
        return
    for cmd in (["diagnose", str(cap)], ["diagnose", str(cap), "--format", "json"], ["summary", str(cap)],
                ["report", str(cap), "-o", str(tmp_path / "r.html")]):
        r = _run(*cmd)
        assert r.exit_code == 0, (cmd, r.output)  # 0: done, incidents or not
        assert not r.exception or isinstance(r.exception, SystemExit), (cmd, repr(r.exception))
        assert "\x1b" not in r.output
