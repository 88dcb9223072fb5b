"""Fleet mode: diagnose many inference servers through Prometheus (docs/fleet.md)."""
from .client import PromClient, PromError
from .fleet import FleetData, FleetDiagnosis, diagnose_fleet, fetch, from_capture, render_text

__all__ = ["FleetData", "FleetDiagnosis", "PromClient", "PromError", "diagnose_fleet", "fetch", "from_capture",
           "render_text"]
