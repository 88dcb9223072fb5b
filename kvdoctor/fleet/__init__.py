"""Fleet mode: diagnose many inference servers through Prometheus (docs/fleet.md).

fetch.py gets every replica's engine samples, captures.py turns them into captures (and back),
diagnosis.py runs the rules on each replica, findings.py and outliers.py compare the replicas;
kvdoctor/report/ renders the result (fleet_text.py, fleet_html.py)."""
from .captures import from_capture
from .client import PromClient, PromError
from .diagnosis import FleetDiagnosis, diagnose_fleet
from .fetch import FleetData, fetch

__all__ = ["FleetData", "FleetDiagnosis", "PromClient", "PromError", "diagnose_fleet", "fetch", "from_capture"]
