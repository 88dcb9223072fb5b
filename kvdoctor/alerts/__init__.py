"""Prometheus alerting rules generated from kvdoctor's rules and engine tables (export.py,
promql.py) and the runbook pages they link to (runbooks.py)."""
