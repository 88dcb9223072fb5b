"""Issue 35: every importer, fed a real file of its format with one or two fields made hostile
(wrong JSON type, null, "Infinity", 1e308, a 200,000-character string, a per-request list cut
short, bytes that are not UTF-8), either imports it (and `summary` then reads the capture) or
answers exit 2 with one stderr line naming the file and what it expected. Never exit 70, never a
traceback. The known hostile files from the issue are explicit cases at the end.

Mutations start from the repository's real files (tests/data), so most examples reach deep into
each importer rather than failing on the first key."""
from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvdoctor.cli import cli  # noqa: E402

DATA = Path(__file__).parent / "data"
TRACES = DATA / "traces"
FUZZ = settings(max_examples=int(os.environ.get("KVDOCTOR_FUZZ_EXAMPLES", "40")), deadline=None,
                suppress_health_check=list(HealthCheck), derandomize=True)

HUGE = "x" * 200_000
HOSTILE: list[Any] = [None, True, False, 0, -1, -1e308, 1e308, 10**30, 2**64, "", "x", "Infinity", "-Infinity", "NaN",
                      "1e999", [], {}, [None], [[]], {"a": None}, {"value": "x", "unit": "ms"}, HUGE, [HUGE],
                      [1e308] * 3, list(range(50)),
                      # OTLP attribute values as protobuf JSON writes them (it allows "Infinity" and "NaN")
                      {"doubleValue": "Infinity"}, {"intValue": "Infinity"}, {"stringValue": "Infinity"},
                      {"doubleValue": "NaN"}, {"intValue": "-5"}, {"doubleValue": 1e308}, {"boolValue": True}]
CSV_COLUMNS = ["--col", "arrival_s=launch_time", "--col", "finish_s=finish_time", "--col", "ttft_s=ttft",
               "--col", "prompt_tokens=prompt_tokens", "--col", "output_tokens=generation_tokens",
               "--col", "session_id=user_id"]


def _jsonl(path: Path, n: int) -> list[Any]:
    return [json.loads(x) for x in path.read_text().splitlines()[:n] if x.strip()]


#: format -> (suffix, a real document (JSON) or list of lines (JSONL), whether JSON Lines, extra args)
TEMPLATES: dict[str, tuple[str, Any, bool, list[str]]] = {
    "vllm-bench": (".json", json.loads((DATA / "vllm_bench" / "vllm-4.0qps-Llama-3.1-8B-Instruct-start_times.json").read_text()),
                   False, []),
    "llmperf": (".json", json.loads((TRACES / "llmperf" / "bedrock_70b.json").read_text())[:4], False, []),
    "aiperf": (".jsonl", _jsonl(TRACES / "aiperf" / "profile_export.jsonl", 3), True, []),
    "guidellm": (".json", json.loads((TRACES / "guidellm" / "benchmarks_stripped.json").read_text()), False, []),
    "otlp-json": (".json", json.loads((DATA / "otlp" / "vllm-0.32-llm_request-span.json").read_text()), False, []),
    "mooncake": (".jsonl", _jsonl(TRACES / "mooncake_conversation_trace_head2000.jsonl", 4), True, []),
}


def _paths(obj: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON document (the root too), depth first."""
    out = [at]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, at + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            out += _paths(v, at + (i,))
    return out


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return doc


def _get(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _mutate(doc: Any, draws: list[tuple[int, int, str]]) -> Any:
    """Apply each (path index, hostile index, how) to a copy: replace the value, cut a list
    short (unequal per-request lists), or drop the key."""
    doc = copy.deepcopy(doc)
    for path_i, value_i, how in draws:
        paths = _paths(doc)
        path = paths[path_i % len(paths)]
        target = _get(doc, path)
        if how == "cut" and isinstance(target, list) and target:
            target[:] = target[: len(target) // 2]
        elif how == "drop" and path and isinstance(_get(doc, path[:-1]), dict):
            del _get(doc, path[:-1])[path[-1]]
        else:
            doc = _set(doc, path, copy.deepcopy(HOSTILE[value_i % len(HOSTILE)]))
    return doc


def _encode(doc: Any, jsonl: bool, bad_utf8: bool) -> bytes:
    if jsonl and isinstance(doc, list):
        data = b"\n".join(json.dumps(x).encode() for x in doc) + b"\n"
    else:
        data = json.dumps(doc).encode()
    if bad_utf8:  # a byte that is not UTF-8 inside the first string value
        at = data.find(b'"', data.find(b":")) + 1
        data = data[:at] + b"\xff\xfe" + data[at:]
    return data


def check_import(fmt: str, src: Path, out: Path, extra: list[str]) -> None:
    """The one property: imported (and readable by summary), or one located line, exit 2."""
    res = CliRunner().invoke(cli, ["import", fmt, str(src), "-o", str(out), *extra])
    assert "Traceback" not in res.output, res.output
    if res.exit_code == 0:
        s = CliRunner().invoke(cli, ["summary", str(out)])
        assert s.exit_code in (0, 6), (s.exit_code, s.output[-2000:], s.exception)
        if s.exit_code == 6:
            assert len(s.stderr.strip().splitlines()) == 1 and s.stderr.startswith("kvdoctor: nothing to diagnose: ")
        return
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, (res.exit_code, res.output[-2000:], repr(res.exception))
    assert len(lines) == 1 and lines[0].startswith("kvdoctor: error: "), res.stderr
    assert src.name in lines[0] or "--" in lines[0], lines[0]  # the file, or the option at fault
    assert not out.exists(), "a refused import left its output folder behind"


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_every_importer_survives_hostile_fields(fmt):
    suffix, template, jsonl, extra = TEMPLATES[fmt]

    @FUZZ
    @given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, len(HOSTILE) - 1),
                              st.sampled_from(["set", "set", "set", "cut", "drop"])), min_size=1, max_size=3),
           st.booleans())
    def check(draws, bad_utf8):
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / f"in{suffix}"
            src.write_bytes(_encode(_mutate(template, draws), jsonl, bad_utf8 and len(draws) == 1))
            check_import(fmt, src, Path(d) / "cap", extra)

    check()


CSV_HEAD = (TRACES / "aibrix" / "naive_output_0.1.csv").read_text().splitlines()[:4]
CSV_CELLS = ["", "x", "-1", "1e308", "nan", "inf", "-inf", "1e999", HUGE[:1000], '"', '"unterminated', "1,2", "\x00",
             "\xff", "2026-11-30T08:00:00Z", "9" * 400]


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 7), st.integers(0, len(CSV_CELLS) - 1)), min_size=1,
                max_size=4), st.sampled_from(["", "header", "ragged", "long-header"]))
def test_csv_survives_hostile_cells(edits, shape):
    rows = [r.split(",") for r in CSV_HEAD]
    for row_i, col_i, cell_i in edits:
        row = rows[row_i % len(rows)]
        row[col_i % len(row)] = CSV_CELLS[cell_i]
    if shape == "ragged":
        rows[2] = rows[2][:3]
    elif shape == "long-header":
        rows[0].append("y" * 200_000)
    text = "\n".join(",".join(r) for r in rows) + "\n"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "in.csv"
        src.write_bytes(text.encode("utf-8", errors="surrogateescape"))
        check_import("csv", src, Path(d) / "cap", CSV_COLUMNS)


# -- the hostile files named in issue 35, each as written ------------------------------------------

def _otlp_template() -> dict:
    return copy.deepcopy(TEMPLATES["otlp-json"][1])


def _span_attrs(doc: dict) -> list[dict]:
    return doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]


def _known_cases() -> dict[str, tuple[str, str, bytes, list[str], str]]:
    """name -> (format, suffix, bytes, extra args, what the one error line must say; "" = imports)."""
    bench = copy.deepcopy(TEMPLATES["vllm-bench"][1])
    bench["itls"] = bench["itls"][:2]
    otlp_not_list = _otlp_template()
    otlp_not_list["resourceSpans"] = {"x": 1}
    otlp_inf, otlp_inf_double = _otlp_template(), _otlp_template()
    for doc, value in ((otlp_inf, {"intValue": "Infinity"}), (otlp_inf_double, {"doubleValue": "Infinity"})):
        for a in _span_attrs(doc):
            if a["key"] == "gen_ai.usage.completion_tokens":
                a["value"] = value
    llmperf = json.dumps(TEMPLATES["llmperf"][1]).encode()
    return {
        "vllm-bench lists of unequal length": ("vllm-bench", ".json", json.dumps(bench).encode(), [], "field itls has 2 entries"),
        "csv header of one 200,000-character column": ("csv", ".csv", b"a" * 200_000 + b"\n1\n", ["--col", "ttft_s=ttft"],
                                                       "line 1: field larger than field limit"),
        "otlp resourceSpans not a list": ("otlp-json", ".json", json.dumps(otlp_not_list).encode(), [], "resourceSpans"),
        "otlp token count Infinity": ("otlp-json", ".json", json.dumps(otlp_inf).encode(), [], "Infinity"),
        "otlp token count Infinity as a double": ("otlp-json", ".json", json.dumps(otlp_inf_double).encode(), [],
                                                  "gen_ai.usage.completion_tokens: expected a finite number"),
        "aiperf given llmperf's JSON": ("aiperf", ".jsonl", llmperf, [], "llmperf"),
        "aiperf given vLLM bench's JSON": ("aiperf", ".jsonl", json.dumps(TEMPLATES["vllm-bench"][1], indent=1).encode(),
                                           [], "vllm-bench"),
    }


@pytest.mark.parametrize("name", sorted(_known_cases()))
def test_known_hostile_files(name, tmp_path):
    fmt, suffix, data, extra, needle = _known_cases()[name]
    src = tmp_path / f"in{suffix}"
    src.write_bytes(data)
    out = tmp_path / "cap"
    check_import(fmt, src, out, extra)
    if needle:
        res = CliRunner().invoke(cli, ["import", fmt, str(src), "-o", str(out), *extra])
        assert res.exit_code == 2 and needle in res.stderr, res.stderr


FORMATS = {"vllm-bench": ".json", "llmperf": ".json", "csv": ".csv", "mooncake": ".jsonl", "otlp-json": ".json",
           "aiperf": ".jsonl", "guidellm": ".json", "prometheus": ".prom"}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_empty_file_says_it_is_empty(fmt, tmp_path):
    src = tmp_path / f"empty{FORMATS[fmt]}"
    src.write_bytes(b"")
    res = CliRunner().invoke(cli, ["import", fmt, str(src), "-o", str(tmp_path / "cap"),
                                   *(["--col", "ttft_s=ttft"] if fmt == "csv" else [])])
    assert res.exit_code == 2, res.output
    (line,) = res.stderr.strip().splitlines()
    assert f"{src}: empty" in line, line


#: a real file of one format given to another importer: the error says what the file looks like
OTHER = {"llmperf": TRACES / "llmperf" / "bedrock_70b.json", "aiperf": TRACES / "aiperf" / "profile_export.jsonl",
         "vllm-bench": DATA / "vllm_bench" / "vllm-4.0qps-Llama-3.1-8B-Instruct-start_times.json",
         "guidellm": TRACES / "guidellm" / "benchmarks_stripped.json",
         "otlp-json": DATA / "otlp" / "vllm-0.32-llm_request-span.json",
         "mooncake": TRACES / "mooncake_conversation_trace_head2000.jsonl",
         "csv": TRACES / "aibrix" / "naive_output_0.1.csv", "prometheus": DATA / "metrics" / "vllm-0.32-cpu-under-load.prom"}


@pytest.mark.parametrize("fmt", sorted(OTHER))
@pytest.mark.parametrize("given_as", sorted(OTHER))
def test_another_formats_file_is_named(fmt, given_as, tmp_path):
    if fmt == given_as:
        return
    extra = ["--col", "ttft_s=ttft"] if given_as == "csv" else []
    res = CliRunner().invoke(cli, ["import", given_as, str(OTHER[fmt]), "-o", str(tmp_path / "cap"), *extra])
    assert res.exit_code == 2, (res.exit_code, res.output[-500:])
    (line,) = res.stderr.strip().splitlines()
    assert "not valid JSON" not in line, line
    assert f"kvdoctor import {fmt}" in line, line


# -- capture records: every stream's fields null or of the wrong type --------------------------------

def _capture_lines() -> dict[str, list[dict]]:
    """A small capture of every stream, from real ones: requests, engine, events and host from a
    vLLM run, GPU samples from a rule case."""
    vllm, gpu = Path(__file__).parents[1] / "samples" / "vllm-preemption", Path(__file__).parent / "rulecases" / "healthy"
    out = {kind: _jsonl(vllm / f"{kind}-000001.jsonl", 12) for kind in ("requests", "engine", "events", "host")}
    out["gpu"] = _jsonl(gpu / "gpu-000001.jsonl", 12)
    out["meta"] = [json.loads((vllm / "meta.json").read_text())]
    return out


CAPTURE = _capture_lines()
CAPTURE_HOSTILE = [None, True, "x", "", -1, 1e308, -1e308, 10**30, [], {}, [None], {"a": [1]}, "NaN", [1, "x"], HUGE[:5000]]


def check_capture(folder: Path) -> None:
    """`summary` prints or says in one line what is wrong where (exit 2), or that there is nothing
    to diagnose (6); never exit 70 or a traceback."""
    res = CliRunner().invoke(cli, ["summary", str(folder)])
    assert "Traceback" not in res.output
    assert res.exit_code in (0, 2, 6), (res.exit_code, res.output[-1500:], repr(res.exception))
    if res.exit_code:
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        if res.exit_code == 2:
            assert "-000001.jsonl" in lines[0] or "meta.json" in lines[0], lines[0]


@FUZZ
@given(st.sampled_from(sorted(CAPTURE)), st.integers(0, 11), st.integers(0, 10_000), st.integers(0, len(CAPTURE_HOSTILE) - 1),
       st.sampled_from(["set", "set", "drop"]))
def test_every_capture_field_null_or_wrong_type(kind, line, path_i, value_i, how):
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        for k, recs in CAPTURE.items():
            recs = copy.deepcopy(recs)
            if k == kind:
                i = line % len(recs)
                rec = recs[i]
                paths = [p for p in _paths(rec) if p]  # a field, or a field inside one (values.kv_usage_frac)
                path = paths[path_i % len(paths)]
                if how == "drop" and isinstance(_get(rec, path[:-1]), dict):
                    del _get(rec, path[:-1])[path[-1]]
                else:
                    _set(rec, path, copy.deepcopy(CAPTURE_HOSTILE[value_i]))
            if k == "meta":
                (folder / "meta.json").write_text(json.dumps(recs[0]))
            else:
                (folder / f"{k}-000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        check_capture(folder)
