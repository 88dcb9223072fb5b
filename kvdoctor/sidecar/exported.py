"""The metrics kvdoctor's sidecar exports on its own /metrics, as a table: one place that the
sidecar, the Grafana dashboards and their tests all read. Names are stable: users alert on them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exported:
    name: str
    kind: str  # gauge | counter
    labels: tuple[str, ...]
    doc: str


QUANTILE = ("quantile",)

METRICS: tuple[Exported, ...] = (
    Exported("kvdoctor_ttft_seconds", "gauge", QUANTILE, "TTFT percentile over the live window (quantile=0.5|0.9|0.99)"),
    Exported("kvdoctor_tpot_seconds", "gauge", QUANTILE, "TPOT percentile over the live window"),
    Exported("kvdoctor_itl_seconds", "gauge", QUANTILE, "inter-token latency percentile over the live window"),
    Exported("kvdoctor_e2e_seconds", "gauge", QUANTILE, "end-to-end latency percentile over the live window"),
    Exported("kvdoctor_requests_total", "counter", ("status",), "requests seen by kvdoctor (proxy, OTLP or engine timings)"),
    Exported("kvdoctor_incident_active", "gauge", ("rule", "symptom", "severity"), "1 while an incident with this top cause is open"),
    Exported("kvdoctor_incidents_opened_total", "counter", ("rule",), "incidents opened, by top-cause rule"),
    Exported("kvdoctor_kv_usage_ratio", "gauge", (), "KV cache usage the engine reports (0..1)"),
    Exported("kvdoctor_kv_full_forecast_seconds", "gauge", (), "time until the KV cache is full at the current growth rate (0: full now, requests wait for KV; NaN when not growing)"),
    Exported("kvdoctor_gpu_memory_used_bytes", "gauge", ("gpu",), "GPU memory in use"),
    Exported("kvdoctor_gpu_memory_total_bytes", "gauge", ("gpu",), "GPU memory in all"),
    Exported("kvdoctor_gpu_memory_bandwidth_ratio", "gauge", ("gpu",), "DRAM bandwidth utilisation (GPM) or memory utilisation (0..1)"),
    Exported("kvdoctor_source_up", "gauge", ("source",), "1 when the source (nvml, host, scrape, proxy, otlp) reads, 0 when not"),
    Exported("kvdoctor_capture_records_total", "counter", ("kind",), "records written to the capture"),
    Exported("kvdoctor_capture_dropped_total", "counter", ("kind",),
             "records that could not be written (full or read-only disk); each loss is also an event in the capture"),
    Exported("kvdoctor_collector_errors_total", "counter", ("source",),
             "unexpected errors in a source or in recording what it read (logged once each; the source goes on)"),
    Exported("kvdoctor_server_up", "gauge", (), "1 while the inference server answers"),
    Exported("kvdoctor_info", "gauge", ("server", "engine", "version"),
             "1; the server URL this sidecar watches, its engine and kvdoctor's version (fleet mode joins on `server`)"),
)

NAMES = frozenset(m.name for m in METRICS)
