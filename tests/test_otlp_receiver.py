"""The OTLP/HTTP receiver, fed by the real OpenTelemetry SDK and exporter with vLLM-shaped spans."""
import asyncio
import gzip
import threading
import urllib.error
import urllib.request

import pytest
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvdoctor.collect.base import ListSink, SourceUnavailable
from kvdoctor.collect.otlp_receiver import STATS, start_receiver

T0_NS = 1_717_000_000_000_000_000  # span start = the request's arrival


class Receiver:
    """start_receiver on a free loopback port, on an event loop in a background thread."""

    def __init__(self):
        self.sink = ListSink()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = self.call(start_receiver(self.sink, "127.0.0.1", 0))
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    @property
    def stats(self):
        return self.runner.app[STATS]

    def close(self):
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def vllm_span(tracer, i, *, error=False, **over):
    attrs = {
        "gen_ai.request.id": f"cmpl-{i}",
        "gen_ai.response.model": "meta-llama/Llama-3.1-8B-Instruct",
        "gen_ai.request.max_tokens": 256, "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0,
        "gen_ai.request.n": 1, "gen_ai.usage.num_sequences": 1,
        "gen_ai.usage.prompt_tokens": 1000 + i, "gen_ai.usage.completion_tokens": 101,
        "gen_ai.latency.time_in_queue": 0.05 * i,
        "gen_ai.latency.time_to_first_token": 0.25 + 0.05 * i,
        "gen_ai.latency.time_in_model_prefill": 0.2,
        "gen_ai.latency.time_in_model_decode": 2.0,
        "gen_ai.latency.e2e": 2.25 + 0.05 * i,
        **over,
    }
    start = T0_NS + i * 1_000_000_000
    span = tracer.start_span("llm_request", kind=SpanKind.SERVER, start_time=start, attributes=attrs)
    if error:
        span.set_status(Status(StatusCode.ERROR, "engine dead"))
    span.end(end_time=start + int(attrs["gen_ai.latency.e2e"] * 1e9))


def provider(url, processor=SimpleSpanProcessor, **kw):
    tp = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
    exporter = OTLPSpanExporter(endpoint=url, timeout=10, **kw)
    tp.add_span_processor(processor(exporter))
    return tp


def test_sdk_exporter_spans_become_requests(receiver):
    tp = provider(receiver.url)
    tracer = tp.get_tracer("vllm.llm_engine")
    for i in range(3):
        vllm_span(tracer, i)
    with tracer.start_as_current_span("http.request"):  # not an LLM request: skipped
        pass
    vllm_span(tracer, 3, error=True)
    tp.shutdown()

    recs = {r.request_id: r for r in receiver.sink.records}
    assert set(recs) == {"cmpl-0", "cmpl-1", "cmpl-2", "cmpl-3"}
    r = recs["cmpl-2"]
    assert r.arrival_s == pytest.approx(T0_NS / 1e9 + 2)
    assert r.ttft_s == pytest.approx(0.35) and r.e2e_s == pytest.approx(2.35) and r.queue_s == pytest.approx(0.1)
    assert r.tpot_s == pytest.approx(2.0 / 100)  # decode time / (completion tokens - 1)
    assert (r.prompt_tokens, r.output_tokens) == (1002, 101)
    assert r.model == "meta-llama/Llama-3.1-8B-Instruct" and r.status == "ok"
    assert r.first_token_s == pytest.approx(r.arrival_s + 0.35) and r.finish_s == pytest.approx(r.arrival_s + 2.35)
    assert recs["cmpl-3"].status == "error" and recs["cmpl-3"].error == "engine dead"
    assert receiver.stats["spans"] == 5 and receiver.stats["records"] == 4 and receiver.stats["bad"] == 0
    assert receiver.sink.status["otlp"][0] is True and str(receiver.port) in receiver.sink.status["otlp"][1]


def test_batch_processor_gzip(receiver):
    tp = provider(receiver.url, BatchSpanProcessor, compression=Compression.Gzip)
    tracer = tp.get_tracer("vllm.llm_engine")
    for i in range(20):
        vllm_span(tracer, i)
    assert tp.force_flush(10_000)
    tp.shutdown()
    assert len(receiver.sink.records) == 20
    assert receiver.stats["requests"] <= 2  # batched


def captured_request():
    """The ExportTraceServiceRequest bytes the SDK's exporter would POST, for hand-made posts."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Capture(SpanExporter):
        spans = []

        def export(self, spans):
            self.spans.extend(spans)
            return SpanExportResult.SUCCESS

    cap = Capture()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(cap))
    tracer = tp.get_tracer("vllm.llm_engine")
    vllm_span(tracer, 1)
    vllm_span(tracer, 2, **{"gen_ai.usage.prompt_tokens": "many"})  # a wrong type: rejected alone
    tp.shutdown()
    return encode_spans(cap.spans)


def post(url, body, content_type, encoding=None):
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": content_type})
    if encoding:
        req.add_header("Content-Encoding", encoding)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def test_json_gzip_and_partial_success(receiver):
    msg = captured_request()
    body = json_format.MessageToJson(msg).encode()
    status, ctype, out = post(receiver.url, body, "application/json")
    assert status == 200 and ctype.startswith("application/json")
    resp = json_format.Parse(out, ExportTraceServiceResponse())
    assert resp.partial_success.rejected_spans == 1
    assert "gen_ai.usage.prompt_tokens" in resp.partial_success.error_message
    [r] = receiver.sink.records
    assert r.request_id == "cmpl-1" and r.ttft_s == pytest.approx(0.3) and r.output_tokens == 101

    status, ctype, out = post(receiver.url, gzip.compress(msg.SerializeToString()), "application/x-protobuf", "gzip")
    assert status == 200 and ctype == "application/x-protobuf"
    assert ExportTraceServiceResponse.FromString(out).partial_success.rejected_spans == 1
    assert [r.request_id for r in receiver.sink.records] == ["cmpl-1", "cmpl-1"]

    # OTLP/JSON as the collector writes it: hex trace/span ids
    obj = json_format.MessageToDict(msg)
    for rs in obj["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for sp in ss["spans"]:
                sp["traceId"], sp["spanId"] = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    import json
    assert post(receiver.url, json.dumps(obj).encode(), "application/json")[0] == 200
    assert len(receiver.sink.records) == 3


def test_bad_requests(receiver):
    status, ctype, out = post(receiver.url, b"\xff\xfe garbage \x00\x01", "application/x-protobuf")
    assert status == 400 and ctype == "application/x-protobuf"
    assert status_pb2.Status.FromString(out).message.startswith("not an ExportTraceServiceRequest")

    status, ctype, out = post(receiver.url, b"{not json", "application/json")
    assert status == 400 and "not valid JSON" in json_format.Parse(out, status_pb2.Status()).message

    assert post(receiver.url, b"[1, 2]", "application/json")[0] == 400
    assert post(receiver.url, b"not gzip at all", "application/x-protobuf", "gzip")[0] == 400

    status, _, out = post(receiver.url, b"x", "text/plain")
    assert status == 415 and "application/x-protobuf" in status_pb2.Status.FromString(out).message
    assert post(receiver.url, b"x", "application/x-protobuf", "br")[0] == 415
    assert receiver.sink.records == [] and receiver.stats["bad"] == 6

    empty = post(receiver.url, b"", "application/x-protobuf")  # an empty export is valid
    assert empty[0] == 200 and ExportTraceServiceResponse.FromString(empty[2]) == ExportTraceServiceResponse()


def test_port_in_use(receiver):
    with pytest.raises(SourceUnavailable, match="cannot listen for OTLP"):
        receiver.call(start_receiver(ListSink(), "127.0.0.1", receiver.port))


def test_make_app_under_a_default_aiohttp_server():
    """make_app mounted by someone else's runner (aiohttp inflating gzip itself) still works."""
    from aiohttp.test_utils import TestClient, TestServer

    from kvdoctor.collect.otlp_receiver import make_app

    body = gzip.compress(captured_request().SerializeToString())
    sink = ListSink()

    async def run():
        async with TestClient(TestServer(make_app(sink))) as client:
            resp = await client.post("/v1/traces", data=body, headers={
                "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
            return resp.status, await resp.read()

    status, out = asyncio.run(run())
    assert status == 200 and ExportTraceServiceResponse.FromString(out).partial_success.rejected_spans == 1
    assert [r.request_id for r in sink.records] == ["cmpl-1"]
