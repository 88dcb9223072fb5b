"""Fleet mode: many inference servers diagnosed through Prometheus (docs/fleet.md).

kvdoctor/prometheus fetches every replica's engine samples as captures; here diagnosis.py runs
the rules on each replica, findings.py and outliers.py compare the replicas, overview.py tabulates
them; kvdoctor/report/ renders the result (fleet_text.py, fleet_html.py)."""
from .diagnosis import FleetDiagnosis, diagnose_fleet, engine_rules

__all__ = ["FleetDiagnosis", "diagnose_fleet", "engine_rules"]
