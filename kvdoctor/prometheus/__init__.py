"""A Prometheus server as a source (docs/fleet.md): every inference server behind it as engine
samples per instance, and those as captures.

query.py plans the queries (one ``query_range`` per metric name, not per instance), client.py asks
them, fetch.py maps the answers to one sample list per instance, captures.py turns them into
captures (and a saved range back into instances), source.py picks a live server or a saved range
from the command's options. Diagnosing the instances is kvdoctor/fleet's."""
from .captures import capture_for, from_capture, meta_for, records
from .client import PromClient, PromError
from .fetch import FleetData, fetch, thin_warnings
from .query import Selectors, auto_window
from .source import fetch_from_options

__all__ = ["FleetData", "PromClient", "PromError", "Selectors", "auto_window", "capture_for", "fetch",
           "fetch_from_options", "from_capture", "meta_for", "records", "thin_warnings"]
