"""The OTLP/gRPC receiver, fed with the llm_request spans a real vLLM 0.32 exported (tests/data/otlp)
through a real gRPC channel. test_vllm.py sends it live spans from a running vLLM."""
import asyncio
import base64
import json
import threading
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvdoctor.collect.base import ListSink, SourceUnavailable
from kvdoctor.collect.otlp_grpc import start_grpc_receiver

DATA = Path(__file__).parent / "data" / "otlp"


class GrpcReceiver:
    def __init__(self, port=0, new_loop=asyncio.new_event_loop):
        self.sink = ListSink()
        self.loop = new_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, self.service, self.port = self.call(start_grpc_receiver(self.sink, "127.0.0.1", port))

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def export(self, msg):
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            return trace_service_pb2_grpc.TraceServiceStub(ch).Export(msg, timeout=10)

    def close(self):
        self.call(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(params=["asyncio", "uvloop"])
def receiver(request):
    """On both loops `attach` may run on (uvloop where installed: kvdoctor/cli/attach.py)."""
    new_loop = pytest.importorskip("uvloop").new_event_loop if request.param == "uvloop" else asyncio.new_event_loop
    r = GrpcReceiver(new_loop=new_loop)
    yield r
    r.close()


def load(name):
    return json_format.ParseDict(json.loads((DATA / name).read_text()), ExportTraceServiceRequest())


def test_real_vllm_span_becomes_a_request(receiver):
    raw = json.loads((DATA / "vllm-0.32-llm_request-span-with-traceparent.json").read_text())
    span = raw["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    attrs = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
    resp = receiver.export(load("vllm-0.32-llm_request-span-with-traceparent.json"))
    assert not resp.HasField("partial_success")
    (rec,) = receiver.sink.records
    assert rec.request_id == attrs["gen_ai.request.id"]
    assert rec.trace_id == base64.b64decode(span["traceId"]).hex()
    assert rec.arrival_s == pytest.approx(int(span["startTimeUnixNano"]) / 1e9)
    assert rec.ttft_s == pytest.approx(attrs["gen_ai.latency.time_to_first_token"])
    assert rec.queue_s == pytest.approx(attrs["gen_ai.latency.time_in_queue"])
    assert rec.e2e_s == pytest.approx(attrs["gen_ai.latency.e2e"])
    n_out = int(attrs["gen_ai.usage.completion_tokens"])
    assert rec.output_tokens == n_out and rec.prompt_tokens == int(attrs["gen_ai.usage.prompt_tokens"])
    assert rec.tpot_s == pytest.approx(attrs["gen_ai.latency.time_in_model_decode"] / (n_out - 1))
    assert rec.prefill_s == pytest.approx(attrs["gen_ai.latency.time_in_model_prefill"])
    assert rec.decode_s == pytest.approx(attrs["gen_ai.latency.time_in_model_decode"])
    assert receiver.service.stats == {"requests": 1, "spans": 1, "records": 1, "rejected": 0}
    assert receiver.sink.status["otlp-grpc"][0] is True


def test_wrong_attribute_type_is_a_partial_success(receiver):
    msg = load("vllm-0.32-llm_request-span.json")
    span = msg.resource_spans[0].scope_spans[0].spans[0]
    for kv in span.attributes:
        if kv.key == "gen_ai.latency.e2e":
            kv.value.string_value = "slow"
    good = load("vllm-0.32-llm_request-span-with-traceparent.json").resource_spans[0].scope_spans[0].spans[0]
    msg.resource_spans[0].scope_spans[0].spans.append(good)
    resp = receiver.export(msg)
    assert resp.partial_success.rejected_spans == 1
    assert "gen_ai.latency.e2e" in resp.partial_success.error_message
    assert len(receiver.sink.records) == 1


def test_port_in_use(receiver):
    with pytest.raises(SourceUnavailable, match=f"127.0.0.1:{receiver.port}"):
        GrpcReceiver(port=receiver.port)
