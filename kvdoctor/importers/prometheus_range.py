"""A Prometheus server's history (HTTP API ``query_range``) as one capture, for offline replay.

Same queries and mapping as ``kvdoctor diagnose --prometheus`` (kvdoctor/prometheus, docs/fleet.md):
one ``EngineSample`` per instance and step, its ``server`` field naming the instance; the
capture's meta holds the range and step (``config.fleet``). Replay with
``kvdoctor diagnose --prometheus CAPTURE``. SRC is the Prometheus base URL; options go as
``--opt KEY=VALUE``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InputError
from .base import Imported

NAME = "prometheus-range"
SUMMARY = "a Prometheus server's engine, DCGM and kvdoctor metrics over a time range (HTTP API query_range)"
OPTIONS = {
    "prometheus": "Prometheus base URL (else the first SRC)",
    "selector": "label matchers for every query, e.g. {job=\"vllm\"}",
    "gpu_selector": "matchers for DCGM series instead of selector", "sidecar_selector": "matchers for kvdoctor sidecars' series",
    "since": "range start as a duration before now (default 1h), epoch or ISO time",
    "start": "range start (epoch or ISO)", "end": "range end (default now)",
    "step": "query resolution (default auto: the scrape interval, coarser only for long ranges)", "group_by": "labels naming an instance (default instance)",
    "bearer_token": "bearer token", "basic_auth": "USER:PASS", "ca_file": "CA bundle", "insecure": "true: skip TLS checks",
    "timeout": "per query (default 60s)",
}


def read(paths: list[Path], options: dict[str, Any]) -> Imported:
    from ..prometheus import fetch_from_options, meta_for, records

    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise InputError(f"--opt {sorted(unknown)[0]}: unknown option for format {NAME}; known options: {', '.join(OPTIONS)}")
    url = options.get("prometheus") or (str(paths[0]) if paths else None)
    if not url or not url.startswith(("http://", "https://")):
        raise InputError(f"{NAME}: give the Prometheus base URL (--opt prometheus=http://host:9090)")
    data = fetch_from_options(url, options.get("selector"), options.get("since"), None, options.get("start"),
                              options.get("end"), options.get("step", "auto"), options.get("group_by", "instance"),
                              options.get("bearer_token"), options.get("basic_auth"), options.get("ca_file"),
                              str(options.get("insecure", "")).lower() in ("1", "true", "yes"),
                              options.get("timeout", "60s"), gpu_selector=options.get("gpu_selector"),
                              sidecar_selector=options.get("sidecar_selector"))
    notes = list(data.warnings) + [f"{len(data.samples)} instance(s): {', '.join(sorted(data.samples))}; "
                                   f"{data.queries} queries, {data.bytes} bytes"]
    return Imported(meta=meta_for(data), records=records(data), notes=notes)
