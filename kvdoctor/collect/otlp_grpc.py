"""OTLP/gRPC traces receiver: vLLM's ``--otlp-traces-endpoint`` speaks gRPC unless told
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``, so this is the receiver a plain vLLM needs.

``opentelemetry.proto.collector.trace.v1.TraceService/Export`` takes an ExportTraceServiceRequest;
each LLM request span becomes a RequestRecord exactly as in the HTTP receiver
(:func:`kvdoctor.collect.otlp_receiver.records_from_request`) and goes to ``sink.emit``. Spans with
attributes of the wrong type are counted in ``partial_success``, as the OTLP spec asks. Plain
(insecure) gRPC on 127.0.0.1 by default: the receiver has no authentication.
"""
from __future__ import annotations

import logging

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from ..errors import InputError
from .base import Sink, SourceUnavailable
from .otlp_receiver import records_from_request

log = logging.getLogger(__name__)

NAME = "otlp-grpc"
DEFAULT_PORT = 4317
MAX_MESSAGE_BYTES = 64 << 20


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        #: counters: requests (Export calls), spans, records emitted, rejected spans
        self.stats = {"requests": 0, "spans": 0, "records": 0, "rejected": 0}

    async def Export(self, request: ExportTraceServiceRequest, context) -> ExportTraceServiceResponse:  # noqa: N802
        self.stats["requests"] += 1
        records, errors = records_from_request(request, self.stats)
        for rec in records:
            self.sink.emit(rec)
        self.stats["records"] += len(records)
        response = ExportTraceServiceResponse()
        if errors:
            self.stats["rejected"] += len(errors)
            log.warning("OTLP/gRPC receiver: %d span(s) rejected, first: %s", len(errors), errors[0])
            response.partial_success.rejected_spans = len(errors)
            response.partial_success.error_message = "; ".join(errors[:3])
        return response


class PortUnavailable(SourceUnavailable, InputError):
    """The receiver's port is taken or not an address here: the user's to fix (exit 2, one line),
    not a bug; still a SourceUnavailable to code that starts receivers itself."""


async def start_grpc_receiver(sink: Sink, host: str = "127.0.0.1",
                              port: int = DEFAULT_PORT) -> tuple[grpc.aio.Server, TraceService, int]:
    """Serve the trace service on host:port (0 = a free port); returns (server, service, bound port).
    Raises SourceUnavailable when the port cannot be bound. Stop with ``await server.stop(grace_s)``."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])  # a second receiver on a busy port must fail
    service = TraceService(sink)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:  # grpcio raises RuntimeError when it cannot bind
        bound, why = 0, str(e)
    else:
        why = "address in use or not available"
    if not bound:
        await server.stop(None)
        raise PortUnavailable(f"--otlp-grpc-receiver {host}:{port}: cannot listen for OTLP/gRPC there ({why}); "
                              "choose another HOST:PORT")
    await server.start()
    sink.source_status(NAME, True, f"OTLP/gRPC traces on {host}:{bound}")
    return server, service, bound
