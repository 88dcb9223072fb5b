"""What to ask Prometheus: time range, selector, and one query per wire metric name present.

Plan (docs/fleet.md): one ``label/__name__/values`` call finds which known metric names exist
under the selector; then one ``query_range`` per present wire name (histograms: one per
``_bucket`` name) returns every instance's series at once. Queries never go per instance, so
their number depends on the engines' metric tables, not on the fleet's size. Histograms come
back as raw cumulative ``_bucket`` series and quantiles are computed client-side from bucket
increases (kvdoctor.engines.rates): the same arithmetic, and the same capture shape, as a
capture recorded by the sidecar.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

from ..engines import TABLES
from ..engines.neutral import NEUTRAL, EngineTable, Wire
from ..engines.promtext import FOLD
from ..engines import canonical
from ..errors import InputError
from .. import timeparse
from ..timeparse import epoch_or_iso

#: kvdoctor sidecars' own metrics (kvdoctor/sidecar/exported.py) the fleet view reads
SIDECAR = ("kvdoctor_info", "kvdoctor_incident_active", "kvdoctor_kv_usage_ratio", "kvdoctor_server_up",
           "kvdoctor_gpu_memory_used_bytes", "kvdoctor_gpu_memory_total_bytes", "kvdoctor_gpu_memory_bandwidth_ratio")



#: Prometheus' default scrape interval: assumed when the server does not list its targets
DEFAULT_SCRAPE_S = 15.0
#: points per series the automatic step aims at: enough that an overload lasting a tenth of
#: the range still spans many samples, far below Prometheus' 11,000-point limit per series
AUTO_POINTS = 600
#: fewer samples than this per instance (or per evaluation window: 4) cannot show a trend or a
#: burst: the fleet output says the data is too thin to judge instead of "healthy"
MIN_POINTS = 8
MIN_WINDOW_POINTS = 4


def auto_step(range_s: float, scrape_s: float | None) -> float:
    """The query step for a range: the scrape interval (a finer step only repeats samples), made
    coarser only as far as AUTO_POINTS points per series need, in whole seconds."""
    scrape = scrape_s if scrape_s and scrape_s > 0 else DEFAULT_SCRAPE_S
    return float(max(scrape, -(-range_s // AUTO_POINTS), 1.0))


def auto_window(range_s: float, step_s: float, lookback_s: float) -> tuple[float, float]:
    """(lookback, evaluation step) for a range: at most the usual lookback, at most a fifth of
    the range (a short overload must not drown in a window as long as the range), at least
    MIN_POINTS samples; windows overlap four to one."""
    lookback = max(min(lookback_s, range_s / 5), MIN_POINTS * step_s)
    return lookback, max(step_s, lookback / 4)


def parse_duration(v: str, name: str) -> float:
    try:
        return timeparse.parse_duration(v)
    except ValueError:
        raise InputError(f"--{name} {v!r}: expected a duration like 30s, 5m, 2h") from None


def parse_instant(v: str, name: str, now: float) -> float:
    """Epoch seconds, ISO 8601, ``now``, or a duration meaning that long before now."""
    v = v.strip()
    if v == "now":
        return now
    if timeparse.DURATION.match(v):
        return now - parse_duration(v, name)
    t = epoch_or_iso(v)
    if t is None:
        raise InputError(f"--{name} {v!r}: expected a duration (2h), epoch seconds or ISO time (2026-11-30T08:00:00Z)")
    return t


def time_range(since: str | None, start: str | None, end: str | None, until: str | None = None,
               now: float | None = None, default_since: str = "1h") -> tuple[float, float]:
    now = time.time() if now is None else now
    t1 = parse_instant(end or until or "now", "end", now)
    t0 = parse_instant(start or since or default_since, "start" if start else "since", t1 if (since or not start) and timeparse.DURATION.match((start or since or default_since).strip()) else now)
    if t0 >= t1:
        raise InputError(f"time range is empty: start {t0:.0f} is not before end {t1:.0f}")
    return t0, t1


_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')


def selector_matchers(selector: str | None) -> str:
    """``{job="vllm", ns=~"prod.*"}`` → ``job="vllm",ns=~"prod.*"`` (checked; InputError if malformed)."""
    if not selector:
        return ""
    s = selector.strip()
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
    parts, pos = [], 0
    while pos < len(s):
        m = _MATCHER.match(s, pos)
        if not m:
            raise InputError(f"--selector {selector!r}: expected label matchers like '{{job=\"vllm\"}}'")
        parts.append(f'{m[1]}{m[2]}"{m[3]}"')
        pos = m.end()
        if pos < len(s):
            if s[pos] != ",":
                raise InputError(f"--selector {selector!r}: expected ',' between matchers")
            pos += 1
    return ",".join(parts)


def series_selector(name: str, matchers: str) -> str:
    return "{" + ",".join([f'__name__="{name}"'] + ([matchers] if matchers else [])) + "}"


@dataclass(frozen=True)
class Selectors:
    """Label matchers (checked, without braces) per kind of series: engines, the DCGM exporter
    and kvdoctor sidecars often run as different Prometheus jobs."""
    engine: str = ""
    gpu: str = ""
    sidecar: str = ""

    @classmethod
    def parse(cls, selector: str | None, gpu_selector: str | None = None,
              sidecar_selector: str | None = None) -> "Selectors":
        """From --selector, --gpu-selector, --sidecar-selector (the last two default to the first)."""
        e = selector_matchers(selector)
        return cls(e, selector_matchers(gpu_selector) if gpu_selector is not None else e,
                   selector_matchers(sidecar_selector) if sidecar_selector is not None else e)

    def __str__(self) -> str:
        parts = [f"{{{self.engine}}}"]
        if self.gpu != self.engine:
            parts.append(f"GPU {{{self.gpu}}}")
        if self.sidecar != self.engine:
            parts.append(f"sidecars {{{self.sidecar}}}")
        return ", ".join(parts)

    def for_name(self, name: str) -> str:
        if name.startswith("kvdoctor_"):
            return self.sidecar
        return self.gpu if name.startswith(DCGM_PREFIX) else self.engine


DCGM_PREFIX = "DCGM_FI_"


def _name_regex(prefixes) -> str:
    return "|".join(re.escape(p).replace("\\:", ":") + ".*" for p in sorted(prefixes))


def discovery_selectors(sel: Selectors | str) -> list[str]:
    """``match[]`` selectors for one ``label/__name__/values`` call: every known engine, DCGM and
    sidecar name prefix, each kind under its own matchers (one selector when they agree)."""
    if isinstance(sel, str):
        sel = Selectors(sel, sel, sel)
    engine = {p for t in TABLES for p in t.prefixes if p != DCGM_PREFIX} | {alt for alt, _ in FOLD}

    def one(prefixes, matchers):
        return "{" + ",".join([f'__name__=~"{_name_regex(prefixes)}"'] + ([matchers] if matchers else [])) + "}"

    if sel.engine == sel.gpu == sel.sidecar:
        return [one(engine | {DCGM_PREFIX, "kvdoctor_"}, sel.engine)]
    return [one(engine, sel.engine), one({DCGM_PREFIX}, sel.gpu), one({"kvdoctor_"}, sel.sidecar)]


def _family(name: str) -> str:
    """A metric's family as the engine tables name it: the canonical prefix, without ``_total``
    (a counter is stored with it, and listed in a table with or without it)."""
    name = canonical(name)
    return name[:-6] if name.endswith("_total") else name


@dataclass(frozen=True)
class Planned:
    """One query_range: a wire name as stored (``name``), the table and entries it maps by."""
    name: str
    query: str
    table: EngineTable | None  # None: a kvdoctor sidecar metric
    histogram: bool
    #: (priority, entry) in table order; a series takes the first entry whose labels match
    entries: tuple[tuple[int, Wire], ...] = ()


def plan(names: list[str], sel: Selectors | str) -> list[Planned]:
    """One query per stored metric name that some engine table maps (``_sum``/``_count`` are
    not fetched: the ``+Inf`` bucket is the count)."""
    if isinstance(sel, str):
        sel = Selectors(sel, sel, sel)
    out: list[Planned] = []
    for name in sorted(set(names)):
        matchers = sel.for_name(name)
        if name in SIDECAR:
            out.append(Planned(name, series_selector(name, matchers), None, False))
            continue
        hist = name.endswith("_bucket")
        base = name[:-7] if hist else name
        if name.endswith(("_sum", "_count", "_created")):
            continue
        for t in TABLES:
            rows = tuple((i, w) for i, w in enumerate(t.metrics) if _family(w.wire) == _family(base)
                         and not w.neutral.startswith("config:")
                         and (NEUTRAL[w.neutral].kind == "histogram") == hist)
            if rows:
                out.append(Planned(name, series_selector(name, matchers), t, hist, rows))
                break
    return out
