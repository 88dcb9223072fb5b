"""A Prometheus range as captures: one in-memory capture per replica (for the rules), the whole fleet
as one saved capture (``import prometheus-range``), and such a capture split back into replicas."""
from __future__ import annotations

import time
from pathlib import Path

from ..capture import load_meta, read_dicts
from ..capture.memory import from_records
from ..model import CaptureMeta, EngineSample, Event, SourceStatus
from .fetch import FleetData


def capture_for(data: FleetData, server: str):
    """One replica's samples and events as an in-memory capture, for the rules."""
    meta = CaptureMeta(created_unix_s=time.time(), clock="unix", engine=data.engines.get(server), server=server,
                       origin="prometheus", sources={"prometheus": SourceStatus(True, data.source)})
    return from_records(meta, engine=data.samples[server], events=data.events.get(server, ()),
                        path=f"{data.source}#{server}")


def records(data: FleetData):
    for name in sorted(data.samples):
        yield from data.samples[name]
        yield from data.events.get(name, ())


def meta_for(data: FleetData) -> CaptureMeta:
    engines = {e for e in data.engines.values() if e}
    return CaptureMeta(created_unix_s=time.time(), clock="unix", engine=next(iter(engines)) if len(engines) == 1 else None,
                       origin="import:prometheus-range",
                       sources={"prometheus": SourceStatus(True, f"{data.source} {data.queries} queries, {data.bytes} bytes")},
                       config={"fleet": {"start_s": data.start_s, "end_s": data.end_s, "step_s": data.step_s,
                                         "instances": sorted(data.samples), "warnings": data.warnings}})


def from_capture(folder: str | Path) -> FleetData:
    """A capture saved by ``import prometheus-range`` (or any multi-server engine capture) split
    back into instances for offline replay."""
    folder = Path(folder)
    meta = load_meta(folder)
    warnings: list[str] = []
    eng = read_dicts(folder, "engine", warnings)
    evs = read_dicts(folder, "events", warnings)
    fl = (meta.config or {}).get("fleet", {})
    times = [r["time_s"] for r in eng if "time_s" in r]
    data = FleetData(fl.get("start_s", min(times, default=0.0)), fl.get("end_s", max(times, default=0.0)),
                     fl.get("step_s", 60.0), str(folder), warnings=list(fl.get("warnings", [])) + warnings)
    for r in eng:
        s = r.get("server") or "unknown"
        data.samples.setdefault(s, []).append(EngineSample(time_s=r["time_s"], engine=r.get("engine"), server=s,
                                                           values=r.get("values") or {}, histograms=r.get("histograms") or {}))
        data.engines.setdefault(s, r.get("engine"))
    for e in evs:
        s = e.get("server") or "unknown"
        data.events.setdefault(s, []).append(Event(time_s=e["time_s"], kind=e.get("kind", "note"), server=s,
                                                   detail=e.get("detail") or {}))
    return data
