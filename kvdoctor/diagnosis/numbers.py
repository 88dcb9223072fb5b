"""The key numbers of a capture, as people compare them with `vllm bench serve` or GuideLLM:
requests, duration, rates, TTFT/TPOT/ITL/E2E at P50/P90/P99 and errors, each with the objective
judged beside it and whether it is broken. Every output shows them (text, JSON, the HTML report)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from ..numeric import json_number
from ..objectives import Objective
from ..signals import REGISTRY, Window
from ..signals.harm import readings
from ..signals.quantiles import percentiles

#: (key, label, request column) of the latency rows
LATENCIES = (("ttft", "TTFT", "ttft_s"), ("tpot", "TPOT", "tpot_s"), ("itl", "ITL", None), ("e2e", "E2E", "e2e_s"))
QUANTILES = (50, 90, 99)
MIN_REQUESTS = 5


@dataclass(frozen=True)
class ObjectiveCheck:
    objective: Objective
    measured: float
    broken: bool
    over: int
    total: int

    def to_json(self) -> dict[str, Any]:
        return {**self.objective.to_json(), "measured": json_number(self.measured), "broken": self.broken,
                "over": self.over, "total": self.total}


@dataclass(frozen=True)
class KeyNumbers:
    requests: int
    duration_s: float
    request_rate_per_s: float
    output_tokens_per_s: float
    errors: int | None
    error_rate: float
    #: "ttft" -> {50: seconds, 90: ..., 99: ...} (NaN where not measured)
    latency_s: dict[str, dict[int, float]] = field(default_factory=dict)
    checks: tuple[ObjectiveCheck, ...] = ()
    #: answers the server stopped at the per-request context limit (status 200, so not in
    #: ``errors``); the error-rate objective counts them as failed (output-cut-at-context)
    context_cut: int = 0

    def check_for(self, kind: str) -> list[ObjectiveCheck]:
        return [c for c in self.checks if c.objective.kind == kind]

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "duration_s": json_number(self.duration_s),
            "request_rate_per_s": json_number(self.request_rate_per_s),
            "output_tokens_per_s": json_number(self.output_tokens_per_s),
            "errors": self.errors, "error_rate": json_number(self.error_rate), "context_cut": self.context_cut,
            "latency_s": {k: {f"p{q}": json_number(v) for q, v in row.items()} for k, row in self.latency_s.items()},
            "objectives": [c.to_json() for c in self.checks],
        }


def key_numbers(w: Window, objectives: Iterable[Objective]) -> KeyNumbers:
    """The key numbers over ``w`` (the whole capture, or a range of it)."""
    lat: dict[str, dict[int, float]] = {}
    for key, _, col in LATENCIES:
        if col is None:
            v = w.itl_values()
            v = v if len(v) else w.r("itl_p50_s")
        else:
            v = w.r(col)
        v = v[np.isfinite(v)]
        if len(v) >= MIN_REQUESTS:
            lat[key] = dict(zip(QUANTILES, percentiles(v, QUANTILES)))
        else:
            lat[key] = {q: w.value(f"{key}_p{q}_s") if f"{key}_p{q}_s" in REGISTRY else float("nan") for q in QUANTILES}
    by_signal = {r.signal: r for r in readings(w)}
    checks = []
    for o in objectives:
        r = by_signal.get(o.key)
        if r is not None:
            checks.append(ObjectiveCheck(o, r.measured, r.broken, r.over, r.total))
    errors, cut = w.value("errors"), w.value("context_cut_requests")
    return KeyNumbers(w.n_requests, w.duration_s, w.value("request_rate_per_s"), w.value("output_tokens_per_s"),
                      int(errors) if np.isfinite(errors) else None, w.value("error_rate"), lat, tuple(checks),
                      int(cut) if np.isfinite(cut) else 0)
