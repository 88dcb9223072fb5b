"""Incidents and derived latency percentiles out through OpenTelemetry (OTLP/HTTP), so an
existing collector, Tempo/Jaeger or Grafana sees them: incidents as spans (one per incident,
from open to close, plus a zero-length span when one opens), percentiles as gauges."""
from __future__ import annotations

import threading
from typing import Any

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from .. import __version__


class OtelExport:
    def __init__(self, endpoint: str, interval_s: float = 10.0):
        base = endpoint.rstrip("/")
        resource = Resource.create({"service.name": "kvdoctor", "service.version": __version__})
        self.tracer_provider = TracerProvider(resource=resource)
        self.tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{base}/v1/traces")))
        self.tracer = self.tracer_provider.get_tracer("kvdoctor")
        reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{base}/v1/metrics"),
                                               export_interval_millis=int(interval_s * 1000))
        self.meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
        meter = self.meter_provider.get_meter("kvdoctor")
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()
        for name in ("ttft", "tpot"):
            meter.create_observable_gauge(f"kvdoctor.{name}", callbacks=[self._observe(name)], unit="s",
                                          description=f"{name.upper()} percentile over the live window")

    def _observe(self, prefix: str):
        def callback(_options):
            with self._lock:
                return [Observation(v, {"quantile": k.split("_")[1][1:]}) for k, v in self._values.items()
                        if k.startswith(prefix + "_") and v == v]
        return callback

    def percentiles(self, values: dict[str, float]) -> None:
        with self._lock:
            self._values.update(values)

    def incident(self, what: str, inc: Any) -> None:
        attrs = {"kvdoctor.incident.id": inc.id, "kvdoctor.symptom": inc.symptom, "kvdoctor.severity": inc.severity,
                 "kvdoctor.rule": inc.top.rule.id, "kvdoctor.cause": inc.top.cause,
                 "kvdoctor.confidence": inc.top.confidence, "kvdoctor.fix": inc.top.fixes[0].title}
        start_ns = int(inc.start_s * 1e9)
        if what == "opened":
            span = self.tracer.start_span("kvdoctor.incident.opened", start_time=start_ns, attributes=attrs)
            span.end(end_time=start_ns)
        else:
            span = self.tracer.start_span(f"kvdoctor.incident {inc.top.rule.id}", start_time=start_ns, attributes=attrs)
            span.end(end_time=int((inc.closed_s or inc.end_s) * 1e9))

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
