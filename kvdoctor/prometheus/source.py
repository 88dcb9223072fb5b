"""Where fleet data comes from: a Prometheus server (ranged queries, the step chosen from the
range and the scrape interval) or a capture saved by `kvdoctor import prometheus-range`. The
command line, the importer and on-call all come here."""
from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from .captures import from_capture
from .client import PromClient, PromError
from .fetch import fetch
from .query import DEFAULT_SCRAPE_S, Selectors, auto_step, parse_duration, time_range


def fetch_from_options(prometheus: str, selector, since, until, prom_start, prom_end, step, group_by,
                       bearer_token, basic_auth, ca_file, insecure, prom_timeout, default_since: str = "1h",
                       gpu_selector: str | None = None, sidecar_selector: str | None = None):
    """FleetData from a Prometheus URL, or from a saved capture folder (offline replay)."""
    if not prometheus.startswith(("http://", "https://")):
        if Path(prometheus).is_dir():
            return from_capture(prometheus)
        raise InputError(f"--prometheus {prometheus!r}: expected an http(s):// URL or a capture folder")
    if basic_auth and ":" not in basic_auth:
        raise InputError("--basic-auth: expected USER:PASS")
    t0, t1 = time_range(since, prom_start, prom_end, until, default_since=default_since)
    client = PromClient(prometheus, bearer_token=bearer_token, basic_auth=basic_auth, ca_file=ca_file,
                        insecure=insecure, timeout_s=parse_duration(prom_timeout, "prom-timeout"))
    scrape_s, note = None, None
    if step in (None, "auto"):
        # the step follows the range and the scrape interval, so a short range keeps every scrape
        # (a fixed 60 s step leaves a 10-minute range ten points and a 2-minute overload one or two)
        try:
            scrape_s = client.scrape_interval_s()
        except PromError as e:
            note = f"warning: scrape interval unknown ({e.reason}); assumed {DEFAULT_SCRAPE_S:g}s for the step"
        step_s = auto_step(t1 - t0, scrape_s)
    else:
        step_s = parse_duration(step, "step")
    groups = tuple(g.strip() for g in group_by.split(",") if g.strip()) or ("instance",)
    data = fetch(client, t0, t1, step_s, Selectors.parse(selector, gpu_selector, sidecar_selector), groups)
    data.step_auto, data.scrape_interval_s = step in (None, "auto"), scrape_s
    if note:
        data.warnings.insert(0, note)
    return data
