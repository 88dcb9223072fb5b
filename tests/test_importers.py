"""Importers: real public data in, capture out, numbers unchanged; bad input is one line, exit 2."""
from __future__ import annotations

import base64
import csv
import inspect
import json
import math
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import kvdoctor
from kvdoctor import importers
from kvdoctor.errors import InputError

DATA = Path(__file__).parent / "data"
TRACES = DATA / "traces"
LLMPERF = TRACES / "llmperf"
AIBRIX_41 = TRACES / "aibrix" / "naive_output_4.1.csv"
AZURE = TRACES / "azure2023_AzureLLMInferenceTrace_code_head2000.csv"
MOONCAKE = TRACES / "mooncake_conversation_trace_head2000.jsonl"
VLLM_OLD = DATA / "vllm_bench" / "vllm-2.0qps-Llama-3.1-8B-Instruct-20250601-101500.json"
VLLM_NEW = DATA / "vllm_bench" / "vllm-4.0qps-Llama-3.1-8B-Instruct-start_times.json"
AIPERF = TRACES / "aiperf" / "profile_export.jsonl"
AIPERF_AGG = TRACES / "aiperf" / "profile_export_aiperf.json"
GUIDELLM = TRACES / "guidellm" / "benchmarks_stripped.json"

AIBRIX_COLS = ["--col", "arrival_s=launch_time", "--col", "finish_s=finish_time", "--col", "ttft_s=ttft",
               "--col", "prompt_tokens=prompt_tokens", "--col", "output_tokens=generation_tokens",
               "--col", "session_id=user_id"]
AZURE_COLS = ["--col", "arrival_s=TIMESTAMP", "--col", "prompt_tokens=ContextTokens",
              "--col", "output_tokens=GeneratedTokens"]


def run_cli(*args: str):
    from kvdoctor.cli import cli

    return CliRunner().invoke(cli, ["import", *map(str, args)])


def do_import(tmp_path: Path, *args: str, name: str = "cap") -> kvdoctor.Capture:
    out = tmp_path / name
    res = run_cli(*args, "-o", out)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[-1].startswith("wrote ")
    return kvdoctor.load(out)


def by_id(cap: kvdoctor.Capture) -> dict[str, dict]:
    return {r["request_id"]: r for r in cap.requests.table.to_pylist()}


def assert_one_line_error(res, *needles: str) -> str:
    assert res.exit_code == 2, res.output
    err = res.stderr.strip()
    assert "Traceback" not in res.output
    assert len(err.splitlines()) == 1, err
    assert err.startswith("kvdoctor: error: ")
    for n in needles:
        assert n in err, (n, err)
    return err


# -- registry ---------------------------------------------------------------------------------

def test_registry_lists_formats_and_loads_modules():
    assert set(importers.IMPORTERS) == {"vllm-bench", "llmperf", "csv", "mooncake", "otlp-json", "prometheus",
                                        "prometheus-range", "aiperf", "guidellm"}
    for name in importers.IMPORTERS:
        mod = importers.get(name)
        assert mod.NAME == name and mod.SUMMARY and callable(mod.read)
    with pytest.raises(InputError, match="unknown import format 'nope'.*llmperf"):
        importers.get("nope")


@pytest.mark.parametrize("fmt,path,opts", [
    ("llmperf", LLMPERF / "anyscale_7b.json", {}),
    ("csv", AIBRIX_41, {"columns": {"ttft_s": "ttft"}}),
    ("mooncake", MOONCAKE, {}),
    ("vllm-bench", VLLM_OLD, {}),
    ("aiperf", AIPERF, {}),
    ("guidellm", GUIDELLM, {}),
])
def test_importers_stream_records(fmt, path, opts):
    imported = importers.get(fmt).read([path], opts)
    assert inspect.isgenerator(imported.records)
    assert imported.meta.origin == f"import:{fmt}"


# -- llmperf ----------------------------------------------------------------------------------

def test_llmperf_real_results(tmp_path):
    cap = do_import(tmp_path, "llmperf", LLMPERF / "anyscale_7b.json", LLMPERF / "bedrock_70b.json",
                    LLMPERF / "fireworks_7b.json")
    assert cap.meta.origin == "import:llmperf" and cap.meta.clock == "relative"
    assert len(cap.requests) == 450
    rows = by_id(cap)
    src = json.loads((LLMPERF / "anyscale_7b.json").read_text())
    for i in (0, 17, 149):
        r, s = rows[f"anyscale_7b/{i}"], src[i]
        assert r["ttft_s"] == pytest.approx(s["ttft_s"])
        assert r["e2e_s"] == pytest.approx(s["end_to_end_latency_s"])
        assert r["prompt_tokens"] == s["number_input_tokens"]
        assert r["output_tokens"] == s["number_output_tokens"]
        assert r["tpot_s"] == pytest.approx((s["end_to_end_latency_s"] - s["ttft_s"]) / (s["number_output_tokens"] - 1))
        assert r["status"] == "ok" and r["error"] is None
    bedrock = json.loads((LLMPERF / "bedrock_70b.json").read_text())
    failed = [i for i, s in enumerate(bedrock) if s["error_code"] is not None]
    assert failed, "the bedrock excerpt has llmperf-flagged requests"
    for i in failed:
        r = rows[f"bedrock_70b/{i}"]
        # -100 "Output too few tokens N" is llmperf's own check on a *completed* request: the
        # server answered (TTFT and e2e were measured), so it is not a failure; the flag is kept
        assert bedrock[i]["error_msg"].startswith("Output too few tokens")
        assert r["status"] == "ok"
        assert bedrock[i]["error_msg"] in r["error"]
        assert r["http_status"] is None  # -100 is llmperf's own code, not HTTP
        assert r["ttft_s"] == pytest.approx(bedrock[i]["ttft_s"])
    assert not any(r["status"] == "error" for r in rows.values())
    assert "GEN_TEXT" not in (tmp_path / "cap" / "requests-000001.jsonl").read_text()


def test_llmperf_folder_and_start_time(tmp_path):
    cap = do_import(tmp_path, "llmperf", LLMPERF)  # a folder: its *.json files
    assert len(cap.requests) == 450
    data = [{"ttft_s": 0.2, "end_to_end_latency_s": 1.2, "number_input_tokens": 10, "number_output_tokens": 11,
             "error_code": None, "error_msg": "", "start_time": 3.5},
            {"ttft_s": 0, "end_to_end_latency_s": 0, "number_input_tokens": 10, "number_output_tokens": 0,
             "error_code": 429, "error_msg": "Too Many Requests", "start_time": 4.0}]
    f = tmp_path / "x_individual_responses.json"
    f.write_text(json.dumps(data))
    rows = by_id(do_import(tmp_path, "llmperf", f, name="c2"))
    assert rows["0"]["arrival_s"] == 3.5 and rows["0"]["finish_s"] == pytest.approx(4.7)
    assert rows["0"]["tpot_s"] == pytest.approx(0.1)
    assert rows["1"]["status"] == "rejected" and rows["1"]["http_status"] == 429  # a rate limit refused it
    assert rows["1"]["ttft_s"] is None and rows["1"]["e2e_s"] is None  # 0 = never measured


# -- csv --------------------------------------------------------------------------------------

def test_csv_aibrix(tmp_path):
    cap = do_import(tmp_path, "csv", AIBRIX_41, *AIBRIX_COLS, "--model", "meta-llama/Llama-3.1-8B",
                    "--engine", "vllm")
    assert cap.meta.clock == "unix" and cap.meta.origin == "import:csv"
    assert cap.meta.model == "meta-llama/Llama-3.1-8B" and cap.meta.engine == "vllm"
    with open(AIBRIX_41, newline="") as f:
        src = list(csv.DictReader(f))
    assert len(cap.requests) == len(src) == 404
    rows = by_id(cap)
    for i in (0, 1, 200, 403):
        r, s = rows[str(i)], src[i]
        assert r["arrival_s"] == pytest.approx(float(s["launch_time"]), abs=1e-6)
        assert r["finish_s"] == pytest.approx(float(s["finish_time"]), abs=1e-6)
        assert r["ttft_s"] == pytest.approx(float(s["ttft"]))
        assert r["prompt_tokens"] == int(float(s["prompt_tokens"]))
        assert r["output_tokens"] == int(float(s["generation_tokens"]))
        assert r["session_id"] == s["user_id"]
        e2e = float(s["finish_time"]) - float(s["launch_time"])
        assert r["e2e_s"] == pytest.approx(e2e, abs=1e-6)
        # AIBrix's generation_time is the decode phase: e2e = ttft + generation_time
        assert e2e == pytest.approx(float(s["ttft"]) + float(s["generation_time"]), abs=1e-3)
        assert r["tpot_s"] == pytest.approx((e2e - float(s["ttft"])) / (int(float(s["generation_tokens"])) - 1), rel=1e-6)
        assert r["first_token_s"] == pytest.approx(float(s["launch_time"]) + float(s["ttft"]), abs=1e-6)


def test_csv_azure_datetimes(tmp_path):
    cap = do_import(tmp_path, "csv", AZURE, *AZURE_COLS)
    assert cap.meta.clock == "unix"
    assert len(cap.requests) == 2000
    with open(AZURE, newline="") as f:
        src = list(csv.DictReader(f))
    rows = by_id(cap)
    for i in (0, 1, 999, 1999):
        r, s = rows[str(i)], src[i]
        want = datetime.fromisoformat(s["TIMESTAMP"]).replace(tzinfo=timezone.utc).timestamp()
        assert r["arrival_s"] == pytest.approx(want, abs=1e-6)
        assert r["prompt_tokens"] == int(s["ContextTokens"])
        assert r["output_tokens"] == int(s["GeneratedTokens"])
    assert rows["0"]["arrival_s"] == pytest.approx(datetime(2023, 11, 16, 18, 17, 3, 979960, timezone.utc).timestamp())
    assert np.all(np.diff(cap.requests.num("arrival_s")) >= 0)


def test_csv_units_lists_and_auto_columns(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("request_id,arrival_s,ttft_s,output_tokens,itl_s\n"
                 "a,1700000000000,120,3,\"[10, 30]\"\n"
                 "b,1700000000500,,2,\n")
    rows = by_id(do_import(tmp_path, "csv", f, "--opt", "duration_unit=ms"))  # columns named like fields
    assert rows["a"]["arrival_s"] == pytest.approx(1.7e9)  # epoch ms recognised by size
    assert rows["b"]["arrival_s"] == pytest.approx(1.7e9 + 0.5)
    assert rows["a"]["ttft_s"] == pytest.approx(0.12)
    assert rows["a"]["itl_s"] == pytest.approx([0.01, 0.03])
    assert rows["a"]["itl_p50_s"] == pytest.approx(0.02)
    assert rows["b"]["ttft_s"] is None
    g = tmp_path / "rel.tsv"
    g.write_text("t\tn\n0.5\t7\n1.25\t8\n")
    cap = do_import(tmp_path, "csv", g, "--col", "arrival_s=t", "--col", "prompt_tokens=n", "--opt", "delimiter=tab",
                    name="c2")
    assert cap.meta.clock == "relative"
    assert cap.requests.num("arrival_s").tolist() == [0.5, 1.25]


# -- mooncake ---------------------------------------------------------------------------------

def test_mooncake_trace(tmp_path):
    cap = do_import(tmp_path, "mooncake", MOONCAKE)
    assert cap.meta.clock == "relative" and len(cap.requests) == 2000
    src = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    rows = by_id(cap)
    for i in (0, 4, 1000, 1999):
        r, s = rows[str(i)], src[i]
        assert r["arrival_s"] == pytest.approx(s["timestamp"] / 1000)
        assert r["prompt_tokens"] == s["input_length"]
        assert r["output_tokens"] == s["output_length"]
        assert r["prefix_block_hashes"] == s["hash_ids"]
        assert r["prefix_block_tokens"] == 512
        assert len(r["prefix_block_hashes"]) == math.ceil(s["input_length"] / 512)
        assert r["ttft_s"] is None and r["e2e_s"] is None
    assert cap.end_s == pytest.approx(src[-1]["timestamp"] / 1000)


# -- vllm bench serve -------------------------------------------------------------------------

def test_vllm_bench_detailed(tmp_path):
    cap = do_import(tmp_path, "vllm-bench", VLLM_OLD)
    src = json.loads(VLLM_OLD.read_text())
    assert cap.meta.model == src["model_id"] and cap.meta.config["benchmark"]["request_rate"] == 2.0
    rows = by_id(cap)
    assert len(rows) == len(src["input_lens"])
    for i, err in enumerate(src["errors"]):
        r = rows[str(i)]
        assert r["prompt_tokens"] == src["input_lens"][i]
        assert r["arrival_s"] is None  # this result has no start_times
        if err:
            assert r["status"] == "error" and "ServerDisconnectedError" in r["error"]
            assert r["ttft_s"] is None and r["output_tokens"] is None
            continue
        itl = src["itls"][i]
        assert r["ttft_s"] == pytest.approx(src["ttfts"][i])
        assert r["itl_s"] == pytest.approx(itl)
        assert r["output_tokens"] == src["output_lens"][i]
        assert r["e2e_s"] == pytest.approx(src["ttfts"][i] + sum(itl))
        assert r["tpot_s"] == pytest.approx(sum(itl) / (src["output_lens"][i] - 1))
        assert r["itl_max_s"] == pytest.approx(max(itl))
        assert r["itl_p99_s"] == pytest.approx(float(np.percentile(itl, 99)))
    text = "".join(p.read_text() for p in (tmp_path / "cap").glob("requests-*.jsonl"))
    assert " the the" not in text  # generated text is never stored


def test_vllm_bench_start_times_and_itl_off(tmp_path):
    src = json.loads(VLLM_NEW.read_text())
    rows = by_id(do_import(tmp_path, "vllm-bench", VLLM_NEW, "--opt", "itl=false"))
    t0 = min(src["start_times"])
    for i in range(len(src["ttfts"])):
        r = rows[str(i)]
        assert r["arrival_s"] == pytest.approx(src["start_times"][i] - t0)
        assert r["first_token_s"] == pytest.approx(src["start_times"][i] - t0 + src["ttfts"][i])
        assert r["itl_s"] is None and r["itl_p50_s"] == pytest.approx(float(np.median(src["itls"][i])))


def test_vllm_bench_append_result(tmp_path):
    f = tmp_path / "appended.json"
    f.write_text(VLLM_OLD.read_text() + "\n" + VLLM_NEW.read_text())
    rows = by_id(do_import(tmp_path, "vllm-bench", f))
    assert len(rows) == 14 and "run1/0" in rows and "run2/5" in rows


def test_vllm_bench_non_streaming_and_e2els(tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"model_id": "m", "input_lens": [5, 6], "output_lens": [4, 3], "ttfts": [0.0, 0.2],
                             "itls": [[], [0.1, 0.1]], "errors": ["", ""], "e2els": [1.5, 0.45]}))
    rows = by_id(do_import(tmp_path, "vllm-bench", f))
    assert rows["0"]["ttft_s"] is None and rows["0"]["e2e_s"] == 1.5 and rows["0"]["status"] == "ok"
    assert rows["1"]["e2e_s"] == 0.45 and rows["1"]["tpot_s"] == pytest.approx(0.125)


# -- OTLP/JSON --------------------------------------------------------------------------------

SPANS = [  # (request id, arrival offset s, ttft, e2e, queue, prefill, decode, prompt, completion, error)
    ("cmpl-a1", 0.00, 0.061, 1.913, 0.004, 0.057, 1.852, 812, 128, None),
    ("cmpl-a2", 0.35, 0.244, 2.731, 0.180, 0.064, 2.487, 1530, 201, None),
    ("cmpl-a3", 0.90, 0.052, 0.052, 0.001, 0.051, 0.0, 97, 1, None),
    ("cmpl-a4", 1.20, None, 3.004, 2.950, None, None, 4000, 0, "request aborted"),
]
T0_NS = 1_748_772_900_123_456_789


def _collector_style(d: dict) -> dict:
    """protobuf JSON -> what the Collector's file exporter writes: hex ids, integer enums."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

    for rs in d["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for sp in ss["spans"]:
                for k in ("traceId", "spanId", "parentSpanId"):
                    if k in sp:
                        sp[k] = base64.b64decode(sp[k]).hex()
                sp["kind"] = Span.SpanKind.Value(sp["kind"])
                if "code" in sp.get("status", {}):
                    sp["status"]["code"] = Status.StatusCode.Value(sp["status"]["code"])
    return d


def make_otlp_file(path: Path, *, collector_style: bool = True) -> Path:
    """vLLM-shaped llm_request spans from the real OpenTelemetry SDK, serialised by the OTLP encoder."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, Status, StatusCode

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("vllm.llm_engine")
    for rid, off, ttft, e2e, queue, prefill, decode, prompt, completion, error in SPANS:
        start = T0_NS + int(off * 1e9)
        span = tracer.start_span("llm_request", kind=SpanKind.SERVER, start_time=start)
        attrs = {"gen_ai.response.model": "meta-llama/Llama-3.1-8B-Instruct", "gen_ai.request.id": rid,
                 "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0, "gen_ai.request.max_tokens": 256,
                 "gen_ai.request.n": 1, "gen_ai.usage.prompt_tokens": prompt,
                 "gen_ai.usage.completion_tokens": completion, "gen_ai.latency.time_in_queue": queue,
                 "gen_ai.latency.time_to_first_token": ttft, "gen_ai.latency.e2e": e2e,
                 "gen_ai.latency.time_in_model_prefill": prefill, "gen_ai.latency.time_in_model_decode": decode}
        span.set_attributes({k: v for k, v in attrs.items() if v is not None})
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=start + int(e2e * 1e9))
    other = provider.get_tracer("opentelemetry.instrumentation.fastapi").start_span("POST /v1/completions")
    other.end()
    spans = exporter.get_finished_spans()
    if not collector_style:  # one pretty-printed protobuf-JSON document, base64 ids
        path.write_text(json.dumps(MessageToDict(encode_spans(spans)), indent=2))
        return path
    lines = [json.dumps(_collector_style(MessageToDict(encode_spans(batch))), separators=(",", ":"))
             for batch in (spans[:2], spans[2:])]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("collector_style", [True, False])
def test_otlp_json_vllm_spans(tmp_path, collector_style):
    f = make_otlp_file(tmp_path / "traces.jsonl", collector_style=collector_style)
    cap = do_import(tmp_path, "otlp-json", f)
    assert cap.meta.clock == "unix" and cap.meta.engine == "vllm"
    assert cap.meta.model == "meta-llama/Llama-3.1-8B-Instruct"
    rows = by_id(cap)
    assert set(rows) == {s[0] for s in SPANS}  # the fastapi span is not a request
    for rid, off, ttft, e2e, queue, prefill, decode, prompt, completion, error in SPANS:
        r = rows[rid]
        assert r["arrival_s"] == pytest.approx((T0_NS + int(off * 1e9)) / 1e9, abs=1e-6)
        assert r["e2e_s"] == pytest.approx(e2e) and r["queue_s"] == pytest.approx(queue)
        assert r["finish_s"] == pytest.approx(r["arrival_s"] + e2e)
        assert r["prompt_tokens"] == prompt and r["output_tokens"] == completion
        assert r["model"] == "meta-llama/Llama-3.1-8B-Instruct"
        if error:
            assert r["status"] == "error" and r["error"] == error and r["ttft_s"] is None
        else:
            assert r["status"] == "ok" and r["ttft_s"] == pytest.approx(ttft)
        if completion > 1:
            assert r["tpot_s"] == pytest.approx(decode / (completion - 1))
        assert r["prefill_s"] == (None if prefill is None else pytest.approx(prefill))
        assert r["decode_s"] == (None if decode is None else pytest.approx(decode))


@pytest.mark.parametrize("name", ["vllm-0.32-llm_request-span.json", "vllm-0.32-llm_request-span-with-traceparent.json"])
def test_real_vllm_span_gives_queue_prefill_and_decode(tmp_path, name):
    """Spans a real vLLM 0.32 exported: the capture keeps its own split of each request, as the
    span's attributes say, through the writer and the reader."""
    f = Path(__file__).parent / "data" / "otlp" / name
    span = json.loads(f.read_text())["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    attrs = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
    (r,) = by_id(do_import(tmp_path, "otlp-json", f)).values()
    assert r["queue_s"] == pytest.approx(attrs["gen_ai.latency.time_in_queue"])
    assert r["prefill_s"] == pytest.approx(attrs["gen_ai.latency.time_in_model_prefill"])
    assert r["decode_s"] == pytest.approx(attrs["gen_ai.latency.time_in_model_decode"])
    # vLLM's engine clock: scheduled..first token lies within arrival..first token seen by the
    # API server, and prefill + decode is its time in the model, within the request's E2E
    assert r["queue_s"] + r["prefill_s"] <= r["ttft_s"]
    assert r["prefill_s"] + r["decode_s"] == pytest.approx(attrs["gen_ai.latency.time_in_model_inference"], abs=1e-6)
    assert r["queue_s"] + r["prefill_s"] + r["decode_s"] <= r["e2e_s"]


def test_request_from_span_attributes():
    from kvdoctor.importers.otlp_json import request_from_span_attributes

    r = request_from_span_attributes({"gen_ai.request.id": "x", "gen_ai.latency.time_to_first_token": 0.5,
                                      "gen_ai.usage.prompt_tokens": 10, "gen_ai.usage.completion_tokens": 5},
                                     2_000_000_000, 4_000_000_000)
    assert (r.request_id, r.arrival_s, r.ttft_s, r.first_token_s) == ("x", 2.0, 0.5, 2.5)
    assert r.finish_s == 4.0 and r.e2e_s == 2.0 and r.tpot_s == pytest.approx(1.5 / 4)
    assert request_from_span_attributes({}, None, None, fallback_id="ab12").request_id == "ab12"
    with pytest.raises(InputError, match="gen_ai.latency.e2e: expected a number"):
        request_from_span_attributes({"gen_ai.request.id": "x", "gen_ai.latency.e2e": "slow"}, None, None)
    # the one error classifier: a cancelled span is not a server error, a 429 is a rate limit
    cancel = request_from_span_attributes({"gen_ai.request.id": "c", "http.response.status_code": 499}, None, None)
    limited = request_from_span_attributes({"gen_ai.request.id": "l", "error.type": "RateLimitError"}, None, None,
                                           error="Rate limit exceeded")
    assert (cancel.status, cancel.http_status, limited.status) == ("cancelled", 499, "rejected")


def test_csv_status_from_the_error_classifier(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("request_id,ttft_s,http_status,error\na,0.1,200,\nb,,499,client closed request\n"
                 "c,,429,Too Many Requests\nd,0.2,,Output too few tokens 12\ne,,500,bloom filter failed\n")
    rows = by_id(do_import(tmp_path, "csv", f))
    assert {k: r["status"] for k, r in rows.items()} == {"a": "ok", "b": "cancelled", "c": "rejected", "d": "ok",
                                                         "e": "error"}


# -- errors: one line, exit 2 -----------------------------------------------------------------

def test_csv_errors(tmp_path):
    out = tmp_path / "o"
    err = assert_one_line_error(run_cli("csv", AIBRIX_41, "-o", out, "--col", "ttft=ttft"),
                                "unknown field 'ttft'", "valid fields:", "ttft_s", "prompt_tokens")
    assert "prompt_text" not in err
    assert_one_line_error(run_cli("csv", AIBRIX_41, "-o", out, "--col", "ttft_s=time_to_first"),
                          str(AIBRIX_41), "no column 'time_to_first'", "header: prompt_tokens, generation_tokens, ttft")
    bad = tmp_path / "bad.csv"
    rows = AIBRIX_41.read_text().splitlines()
    rows[3] = rows[3].replace(rows[3].split(",")[2], "n/a-ish", 1)
    bad.write_text("\n".join(rows) + "\n")
    assert_one_line_error(run_cli("csv", bad, "-o", out, *AIBRIX_COLS),
                          str(bad), "line 4", "column 'ttft'", "expected a number", "'n/a-ish'")
    bad_time = tmp_path / "bad_time.csv"
    bad_time.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,1,2\nyesterday,3,4\n")
    assert_one_line_error(run_cli("csv", bad_time, "-o", out, *AZURE_COLS),
                          "line 3", "column 'TIMESTAMP'", "ISO 8601")
    frac = tmp_path / "frac.csv"
    frac.write_text("ContextTokens\n5\n2.5\n")
    assert_one_line_error(run_cli("csv", frac, "-o", out, "--col", "prompt_tokens=ContextTokens"),
                          "line 3", "expected a whole number")
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("a,b\n1,2\n3\n")
    assert_one_line_error(run_cli("csv", ragged, "-o", out, "--col", "ttft_s=a"), str(ragged), "line 3",
                          "1 fields where the header has 2")
    assert_one_line_error(run_cli("csv", AIBRIX_41, "-o", out, "--col", "nonsense"), "--col nonsense", "FIELD=COLUMN")
    assert_one_line_error(run_cli("csv", AIBRIX_41, "-o", out, "--opt", "time_unit=hours", *AIBRIX_COLS),
                          "time_unit=hours", "expected one of")
    assert not out.exists()


def test_json_format_errors(tmp_path):
    out = tmp_path / "o"
    lines = MOONCAKE.read_text().splitlines()[:5]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:3] + ['{"timestamp": 5, "input_length": 10, "output_length": 1,'] + lines[3:]) + "\n")
    assert_one_line_error(run_cli("mooncake", bad, "-o", out), str(bad), "line 4", "not valid JSON")
    bad.write_text("\n".join(lines[:2] + ['{"input_length": 10, "output_length": 1, "hash_ids": [1]}']) + "\n")
    assert_one_line_error(run_cli("mooncake", bad, "-o", out), "line 3", "field timestamp missing")
    bad.write_text('{"timestamp": 0, "input_length": "many", "hash_ids": []}\n')
    assert_one_line_error(run_cli("mooncake", bad, "-o", out), "line 1", "input_length", "expected a number")

    summary = tmp_path / "x_summary.json"
    summary.write_text(json.dumps({"results": {}, "num_concurrent_requests": 1}))
    assert_one_line_error(run_cli("llmperf", summary, "-o", out), "_summary.json", "_individual_responses.json")
    data = json.loads((LLMPERF / "anyscale_7b.json").read_text())[:3]
    data[2]["ttft_s"] = "fast"
    bad_llmperf = tmp_path / "b_individual_responses.json"
    bad_llmperf.write_text(json.dumps(data))
    assert_one_line_error(run_cli("llmperf", bad_llmperf, "-o", out), "[2].ttft_s", "expected a number", "'fast'")

    plain = json.loads(VLLM_OLD.read_text())
    for k in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"):
        del plain[k]
    nodetail = tmp_path / "nodetail.json"
    nodetail.write_text(json.dumps(plain))
    assert_one_line_error(run_cli("vllm-bench", nodetail, "-o", out), "--save-detailed")
    short = json.loads(VLLM_OLD.read_text())
    short["ttfts"] = short["ttfts"][:-1]
    nodetail.write_text(json.dumps(short))
    assert_one_line_error(run_cli("vllm-bench", nodetail, "-o", out), "field ttfts has 7 entries but input_lens has 8")

    otlp = tmp_path / "t.jsonl"
    otlp.write_text('{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "x", "startTimeUnixNano": "soon"}]}]}]}\n')
    assert_one_line_error(run_cli("otlp-json", otlp, "-o", out), str(otlp), "line 1", "ExportTraceServiceRequest")
    otlp.write_text('{"resourceSpans": []}\n')
    assert_one_line_error(run_cli("otlp-json", otlp, "-o", out), "no LLM request spans")
    assert not out.exists()


def test_cli_usage_errors(tmp_path):
    out = tmp_path / "o"
    assert_one_line_error(run_cli("nope", AIBRIX_41, "-o", out), "unknown import format 'nope'", "vllm-bench")
    assert_one_line_error(run_cli("llmperf", tmp_path / "missing.json", "-o", out), "missing.json: no such file")
    assert_one_line_error(run_cli("mooncake", MOONCAKE, "-o", out, "--col", "a=b"), "--col", "csv only")
    assert_one_line_error(run_cli("mooncake", MOONCAKE, "-o", out, "--opt", "colour=blue"),
                          "--opt colour", "block_tokens")
    assert_one_line_error(run_cli("mooncake", MOONCAKE, "-o", out, "--opt", "block_tokens=big"),
                          "block_tokens=big", "whole number")


def test_existing_capture_needs_force(tmp_path):
    cap = tmp_path / "cap"
    do_import(tmp_path, "mooncake", MOONCAKE)
    assert_one_line_error(run_cli("llmperf", LLMPERF / "anyscale_7b.json", "-o", cap), "--force")
    res = run_cli("llmperf", LLMPERF / "anyscale_7b.json", "-o", cap, "--force",
                  "--opt", "attribution=ray-project/llmperf-leaderboard (Apache-2.0)")
    assert res.exit_code == 0, res.output
    loaded = kvdoctor.load(cap)
    assert len(loaded.requests) == 150 and loaded.meta.origin == "import:llmperf"
    assert loaded.meta.attribution.startswith("ray-project/llmperf-leaderboard")
    assert res.stdout.strip() == f"wrote 150 requests to {cap}"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    assert_one_line_error(run_cli("llmperf", LLMPERF / "anyscale_7b.json", "-o", tmp_path / "other", "--force"),
                          "not a capture")
    assert (tmp_path / "other" / "notes.txt").exists()


def test_samples_load():
    root = Path(__file__).parent.parent / "samples"
    for name, n in (("llmperf-anyscale-7b", 150), ("aibrix-qps-4.1", 404), ("mooncake-conversation", 2000)):
        folder = root / name
        if not folder.exists():
            pytest.skip("samples not built; run scripts/make-samples")
        cap = kvdoctor.load(folder)
        assert len(cap.requests) == n and cap.meta.attribution
        assert sum(p.stat().st_size for p in folder.iterdir()) < 2_000_000


# -- AIPerf ---------------------------------------------------------------------------------

def test_aiperf_real_profile_export(tmp_path):
    """AIPerf's published example run (ai-dynamo/aiperf examples/artifacts/run1): 100 records,
    11 cancelled by the client (code 499). The imported numbers must reproduce AIPerf's own
    aggregate file written next to it, and cancellations are not failures."""
    cap = do_import(tmp_path, "aiperf", AIPERF)
    assert cap.meta.origin == "import:aiperf" and cap.meta.clock == "unix"
    rows = by_id(cap)
    src = [json.loads(line) for line in AIPERF.read_text().splitlines()]
    assert len(rows) == len(src) == 100
    agg = json.loads(AIPERF_AGG.read_text())["records"]
    cancelled = [s for s in src if s["error"]]
    assert len(cancelled) == agg["error_request_count"]["avg"] == 11
    for s in cancelled:
        r = rows[s["metadata"]["x_request_id"]]
        assert s["error"]["code"] == 499 and r["status"] == "cancelled"  # a client cancellation
        assert r["http_status"] == 499 and "RequestCancellationError" in r["error"]
    ok = [r for r in rows.values() if r["status"] == "ok"]
    assert len(ok) == agg["request_count"]["avg"] == 89
    ttft_ms = np.array([r["ttft_s"] for r in ok]) * 1000
    for stat, got in (("p50", np.median(ttft_ms)), ("avg", ttft_ms.mean()), ("min", ttft_ms.min()), ("max", ttft_ms.max())):
        assert got == pytest.approx(agg["ttft"][stat], rel=1e-9), stat
    lat_ms = np.array([r["e2e_s"] for r in ok]) * 1000
    assert np.median(lat_ms) == pytest.approx(agg["request_latency"]["p50"], rel=1e-9)
    assert np.median([r["output_tokens"] for r in ok]) == agg["output_sequence_length"]["p50"]
    # per request: times on the Unix clock from the ns stamps, chunk gaps kept in seconds
    s = next(x for x in src if not x["error"])
    r = rows[s["metadata"]["x_request_id"]]
    assert r["arrival_s"] == pytest.approx(s["metadata"]["timestamp_ns"] / 1e9)
    assert r["finish_s"] == pytest.approx(s["metrics"]["max_response_timestamp"]["value"] / 1e9)
    assert r["itl_s"] == pytest.approx([v / 1000 for v in s["metrics"]["inter_chunk_latency"]["value"]])
    assert r["session_id"] == s["metadata"]["x_correlation_id"] and r["turn"] == 1


def test_aiperf_diagnose_counts_cancellations_apart(tmp_path):
    cap = do_import(tmp_path, "aiperf", AIPERF)
    from kvdoctor.diagnosis import diagnose

    diag = diagnose(cap)
    assert not any(i.symptom == "errors" for i in diag.incidents)
    w = diag.prepared.window(diag.start_s, diag.end_s)
    assert w.value("errors") == 0 and w.value("cancelled_requests") == 11


def test_aiperf_bad_input(tmp_path):
    agg = run_cli("aiperf", AIPERF_AGG, "-o", tmp_path / "x")
    assert_one_line_error(agg, "profile_export_aiperf.json", "profile_export.jsonl")
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"metadata": {"x_request_id": "a"}, "metrics": {"ttft": {"value": 5, "unit": "parsecs"}}, "error": null}\n')
    assert_one_line_error(run_cli("aiperf", bad, "-o", tmp_path / "y"), "line 1", "metrics.ttft.unit")


# -- GuideLLM -------------------------------------------------------------------------------

def test_guidellm_real_report_json_and_yaml(tmp_path):
    """The only GuideLLM report with per-request rows in its public repository: a real run kept
    as a test asset, stripped to one request (vllm-project/guidellm tests/unit/entrypoints/assets)."""
    src = json.loads(GUIDELLM.read_text())["benchmarks"][0]["requests"]["successful"][0]
    for path, name in ((GUIDELLM, "j"), (GUIDELLM.with_suffix(".yaml"), "y")):
        cap = do_import(tmp_path, "guidellm", path, name=name)
        (r,) = by_id(cap).values()
        assert r["request_id"] == src["request_id"] and r["status"] == "ok"
        assert r["arrival_s"] == src["start_time"] and r["finish_s"] == src["end_time"]
        assert r["ttft_s"] * 1000 == pytest.approx(src["time_to_first_token_ms"])
        assert r["first_token_s"] == pytest.approx(src["first_token_time"])
        assert r["e2e_s"] == pytest.approx(src["request_latency"])
        assert (r["prompt_tokens"], r["output_tokens"]) == (src["prompt_tokens"], src["output_tokens"])
        # GuideLLM's inter-token latency is kvdoctor's TPOT (decode time / (tokens - 1))
        assert r["tpot_s"] * 1000 == pytest.approx(src["inter_token_latency_ms"], rel=1e-3)
    assert "such a sacrifice" not in (tmp_path / "j" / "requests-000001.jsonl").read_text()  # no text kept


def test_guidellm_errored_and_incomplete_rows(tmp_path):
    """Rows in the documented schema (newer GuideLLM: info.timings, info.error) for the classes the
    public asset lacks: an errored row is classified, an incomplete one is a cancellation."""
    def row(rid, err=None):
        return {"request_id": rid, "prompt_tokens": 300, "output_tokens": 0, "request_start_time": 100.0,
                "request_end_time": 100.5, "info": {"error": err, "timings": {"request_start": 100.0}}}
    report = {"benchmarks": [{"requests": {"successful": [], "incomplete": [row("c")],
                                           "errored": [row("r", "429, message='Too Many Requests'"),
                                                       row("x", "This model's maximum context length is 4096 tokens")]}}]}
    f = tmp_path / "benchmarks.json"
    f.write_text(json.dumps(report))
    rows = by_id(do_import(tmp_path, "guidellm", f))
    assert rows["c"]["status"] == "cancelled"
    assert rows["r"]["status"] == "rejected" and "Too Many Requests" in rows["r"]["error"]
    assert rows["x"]["status"] == "rejected"
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"benchmarks": [{"requests": {"successful": {"a": 1}}}]}))
    assert_one_line_error(run_cli("guidellm", bad, "-o", tmp_path / "z"), "benchmarks[0].requests.successful")
    assert_one_line_error(run_cli("guidellm", AIPERF_AGG, "-o", tmp_path / "w"), "\"benchmarks\" list")
