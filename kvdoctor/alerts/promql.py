"""kvdoctor signals as PromQL, per engine, from the engine tables (kvdoctor/engines/*.py).

Only signals that follow from one instance's engine metrics have a PromQL form: gauge
percentiles over the window (subqueries), counter rates, and histogram quantiles (the same
bucket arithmetic kvdoctor/engines/rates.py does client-side). Signals computed from per-request
records (prompt length, concurrency at arrival, correlations, fits) have none; :func:`signal`
returns None for them and :data:`WHY_NOT` says why.

Every expression is aggregated ``by (job, instance)`` so that the leaves of a rule's condition
match one another with plain ``and``/``or`` (one instance = one ``instance`` label, as in fleet mode).
Wire names that are alternatives (vLLM v0 vs v1, a counter with or without ``_total``) are joined
with ``or``: an instance exports one of them, and ``or`` keeps the first present.
"""
from __future__ import annotations

from typing import Callable

from ..engines.neutral import NEUTRAL, EngineTable

BY = "job, instance"

#: why a signal has no PromQL form (prefix match on the signal name; the default covers the rest)
WHY_NOT = {
    "queue_share": "needs per-request queue and end-to-end times (request records)",
    "queued_frac": "needs the in-flight count at each request's arrival (request records)",
    "concurrency": "needs per-request start/end times (request records)",
    "ttft_high_over_low": "compares latency at high vs low in-flight counts per request (request records)",
    "tpot_high_over_low": "compares latency at high vs low in-flight counts per request (request records)",
    "kv_full_forecast": "a fitted trend with a goodness-of-fit gate",
    "error_rate_max_1m": "per-minute buckets of request records",
    "kv_usage_over_token_demand": "needs per-request prompt+output lengths (request records)",
    "kv_demand_over_capacity": "needs per-request lengths and the KV capacity from the engine's config",
    # node_exporter's node_schedstat_waiting_seconds_total is per CPU for the whole host, not the server's threads
    "server_run_wait": "the run-queue delay of the server's own threads (/proc/PID/task/*/schedstat, kvdoctor's host collector)",
}


def why_not(signal_name: str) -> str:
    for prefix, why in WHY_NOT.items():
        if signal_name.startswith(prefix):
            return why
    return "computed from request records, correlations or fits outside Prometheus"


def _counter_names(name: str) -> list[str]:
    """A counter's exposed names: a ``_total`` name is what prometheus_client always exposes; a
    name without it (TGI's Rust exporter) gains ``_total`` in newer exporter versions."""
    return [name] if name.endswith("_total") else [name, name + "_total"]


def selectors(table: EngineTable, neutral: str, suffix: str = "") -> list[str]:
    """Series selectors of one neutral name on one engine, first entry first. An entry without
    labels excludes the label values earlier entries of the same wire name took (vLLM's
    ``request_success_total`` split by ``finished_reason``), as the scrape mapping does."""
    out: list[str] = []
    for i, w in enumerate(table.metrics):
        if w.neutral != neutral:
            continue
        if w.scale != 1.0:  # no table entry in use scales today; refuse rather than be wrong
            raise ValueError(f"{table.name}: {w.wire} has scale {w.scale}; PromQL export does not scale")
        matchers = [f'{k}="{v}"' for k, v in w.labels]
        if not w.labels:
            matchers += [f'{k}!="{v}"' for prev in table.metrics[:i] if prev.wire == w.wire for k, v in prev.labels]
        names = _counter_names(w.wire) if NEUTRAL[neutral].kind == "counter" else [w.wire]
        for n in names:
            sel = n + suffix + ("{" + ",".join(matchers) + "}" if matchers else "")
            if sel not in out:
                out.append(sel)
    return out


def _alts(parts: list[str]) -> str | None:
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else "(" + " or ".join(parts) + ")"


def gauge(table: EngineTable, *neutrals: str) -> str | None:
    """The instance's value of a gauge (first neutral name present wins)."""
    parts = []
    for n in neutrals:
        agg = "avg" if NEUTRAL[n].agg == "mean" else "sum"
        parts += [f"{agg} by ({BY}) ({s})" for s in selectors(table, n)]
    return _alts(parts)


def rate(table: EngineTable, neutral: str, window: str, fn: str = "rate") -> str | None:
    return _alts([f"sum by ({BY}) ({fn}({s}[{window}]))" for s in selectors(table, neutral)])


def quantile(table: EngineTable, neutral: str, q: float, window: str) -> str | None:
    return _alts([f"histogram_quantile({q:g}, sum by ({BY}, le) (rate({s}[{window}])))"
                  for s in selectors(table, neutral, "_bucket")])


def _over_time(fn: str, expr: str | None, window: str, q: float | None = None) -> str | None:
    """A gauge's max or quantile over the window: a subquery at the evaluation interval."""
    if expr is None:
        return None
    return f"{fn}({'' if q is None else f'{q:g}, '}({expr})[{window}:])"


def _ratio(a: str | None, b: str | None) -> str | None:
    return None if a is None or b is None else f"({a}) / ({b})"


def _error_parts(t: EngineTable, w: str) -> tuple[str | None, str | None]:
    """(failed, finished) over the window, as signals/outcomes.py reads the engine counters."""
    failed = rate(t, "request_failure_total", w, "increase")
    total = rate(t, "requests_total", w, "increase")
    if total is None:
        ok = rate(t, "request_success_total", w, "increase")
        total = None if ok is None or failed is None else f"({ok} + {failed})"
    return failed, total


def _error_rate(t: EngineTable, w: str) -> str | None:
    failed, total = _error_parts(t, w)
    if failed is None or total is None:
        return None
    return f"({failed} / {total}) and ({total} >= 5)"  # below 5 requests the rate is unknown


#: signal name -> PromQL builder (engine table, window) -> expression or None (no metric on that engine)
SIGNALS: dict[str, Callable[[EngineTable, str], str | None]] = {
    "requests_waiting_p50": lambda t, w: _over_time("quantile_over_time", gauge(t, "requests_waiting", "requests_deferred"), w, 0.5),
    "kv_usage_max_frac": lambda t, w: _over_time("max_over_time", gauge(t, "kv_usage_frac"), w),
    "kv_usage_p50_frac": lambda t, w: _over_time("quantile_over_time", gauge(t, "kv_usage_frac"), w, 0.5),
    "preemptions_per_min": lambda t, w: None if rate(t, "preemptions_total", w) is None else f"60 * {rate(t, 'preemptions_total', w)}",
    "error_rate": _error_rate,
    "errors": lambda t, w: _error_parts(t, w)[0],
}
for _prefix, _hist in (("ttft", "ttft_seconds"), ("tpot", "tpot_seconds"), ("e2e", "e2e_seconds"), ("queue", "queue_seconds")):
    for _q in (50, 90, 99):
        SIGNALS[f"{_prefix}_p{_q}_s"] = lambda t, w, h=_hist, q=_q: quantile(t, h, q / 100, w)
    SIGNALS[f"{_prefix}_p99_over_p50"] = lambda t, w, p=_prefix: _ratio(SIGNALS[f"{p}_p99_s"](t, w), SIGNALS[f"{p}_p50_s"](t, w))


def signal(name: str, table: EngineTable, window: str) -> str | None:
    """PromQL for one signal on one engine over ``window`` (a Prometheus duration), or None."""
    fn = SIGNALS.get(name)
    return None if fn is None else fn(table, window)
