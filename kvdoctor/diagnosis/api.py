"""The library entry point: capture in, incidents out, as objects or the stable JSON shape."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..capture import Capture
from ..numeric import json_number
from ..signals import Prepared
from ..signals.host import CONTENDED_OTHER_FRAC, contended
from ..signals.prepared import READ_BURST_S
from .coverage import NotEvaluated, context_limit, not_evaluated
from .evaluate import Options, incidents
from .incident import Incident, time_label
from .numbers import KeyNumbers, key_numbers
from .rules import Rule, load_rules

JSON_SCHEMA_VERSION = 1

@dataclass
class Diagnosis:
    capture: Capture
    incidents: list[Incident]
    rules: list[Rule]
    options: Options
    start_s: float
    end_s: float
    warnings: list[str] = field(default_factory=list)
    #: the analysed capture, kept so reports reuse it instead of preparing it again
    prepared: Prepared | None = field(default=None, repr=False)
    #: rules that could not fire on this capture, and which signal they lacked
    not_evaluated: list[NotEvaluated] = field(default_factory=list)
    #: the context limit used (tokens) and where it came from; None: unknown
    context_limit_tokens: float | None = None
    context_limit_source: str = ""
    #: False when the capture has no send times: positions are then request numbers in file order
    arrivals_known: bool = True
    #: why there was nothing to judge (no requests or samples, the server down throughout); None
    #: when the capture held something to diagnose. The commands exit with NothingToDiagnose's code.
    nothing_to_diagnose: str | None = None

    @property
    def key_numbers(self) -> KeyNumbers:
        """Requests, rates, latency percentiles and errors over the capture, with the objectives."""
        got = self.__dict__.get("_key_numbers")
        if got is None:
            prep = self.prepared or Prepared(self.capture, self.options.targets, self.options.stated)
            got = self.__dict__["_key_numbers"] = key_numbers(prep.window(self.start_s, self.end_s),
                                                              self.options.objectives or ())
        return got

    @property
    def outcome(self) -> str:
        """``incidents``, ``no-incident`` or ``nothing-to-diagnose``."""
        if self.nothing_to_diagnose:
            return "nothing-to-diagnose"
        return "incidents" if self.incidents else "no-incident"

    def time_label(self, t: float) -> str:
        return time_label(t, self.start_s, self.capture.meta.clock, self.arrivals_known)

    def to_json(self) -> dict[str, Any]:
        meta = self.capture.meta
        return {
            "schema_version": JSON_SCHEMA_VERSION,
            "capture": {
                "path": str(self.capture.path),
                "requests": len(self.capture.requests),
                "start": self.time_label(self.start_s),
                "end": self.time_label(self.end_s),
                "start_s": json_number(self.start_s) if self.arrivals_known else None,
                "end_s": json_number(self.end_s) if self.arrivals_known else None,
                "arrivals_known": self.arrivals_known,
                "engine": meta.engine,
                "model": meta.model,
                "sources": {k: {"ok": v.ok, "detail": v.detail} for k, v in meta.sources.items()},
                "warnings": self.warnings,
                "context_limit": ({"tokens": json_number(self.context_limit_tokens), "source": self.context_limit_source}
                                  if self.context_limit_tokens else None),
            },
            "outcome": self.outcome,
            "nothing_to_diagnose": self.nothing_to_diagnose,
            "slo": self.options.targets,
            "objectives": [o.to_json() for o in self.options.objectives or ()],
            "workload": self.options.workload,
            "key_numbers": self.key_numbers.to_json(),
            "incidents": [i.to_json(self.time_label, self.arrivals_known) for i in self.incidents],
            "not_evaluated": [n.to_json() for n in self.not_evaluated],
        }


def diagnose(capture: Capture, rules: list[Rule] | None = None, options: Options | None = None,
             progress: Callable[[int, int], None] | None = None) -> Diagnosis:
    """Run every rule over the capture and return its incidents, most severe first."""
    rules = rules if rules is not None else load_rules()
    options = (options or Options()).resolve(capture.meta.model)
    prep = Prepared(capture, options.targets, options.stated)
    limit, limit_source, warnings = context_limit(prep, options.max_model_len_tokens)
    found = incidents(prep, rules, options, progress) if (len(capture.requests) or len(prep.engine_t) or len(prep.gpu_t)) else []
    fired = {c.rule.id for inc in found for c in inc.causes}
    whole = prep.window(prep.start_s, prep.end_s)
    missing = not_evaluated(whole, rules, fired, options.targets)
    warnings = list(capture.warnings) + warnings
    if not prep.arrivals_known:
        warnings.append(ARRIVALS_UNKNOWN)
    if n_late := int(prep.read_late.sum()):
        warnings.append(f"{n_late} of {len(prep.t)} streams were read in bursts (most chunks under "
                        f"{READ_BURST_S * 1e3:g} ms apart: the recorder's process was starved of CPU); "
                        "their TPOT and inter-token gaps are left out as not measured")
    if n_held := int(contended(whole).sum()):
        warnings.append(f"{n_held} of {whole.n_requests} requests ran while other processes held at least "
                        f"{CONTENDED_OTHER_FRAC:.0%} of the host's CPUs: trends through the run (growth per turn) "
                        "leave them out, since contention only adds time")
    return Diagnosis(capture, found, rules, options, prep.start_s, prep.end_s, warnings, prep,
                     missing, limit, limit_source, arrivals_known=prep.arrivals_known,
                     nothing_to_diagnose=_nothing_to_diagnose(prep, capture))


def _nothing_to_diagnose(prep: Prepared, capture: Capture) -> str | None:
    """Why the capture holds nothing to judge, or None. Requests are what users felt; without any,
    engine or GPU samples still let the memory and queue rules speak, unless every scrape failed
    because the server was down."""
    n_req = len(capture.requests)
    down = [e for e in prep.events if e.get("kind") == "server-down"]
    if n_req:
        return None
    if down and not len(prep.engine_t):
        return (f"the server was down the whole time ({len(down)} server-down event{'s' * (len(down) > 1)}, "
                "no request and no engine metrics recorded)")
    if not (len(prep.engine_t) or len(prep.gpu_t) or len(prep.host_t)):
        rng = capture.range_text
        return f"no requests and no samples{' in ' + rng if rng else ''}"
    if not len(prep.engine_t) and not len(prep.gpu_t):
        return "no requests, no engine metrics and no GPU samples (only host samples): nothing a rule judges"
    return None


#: the warning every output carries for a capture without send times (llmperf files, old vLLM results)
ARRIVALS_UNKNOWN = ("arrival times unknown (the source has no send times): requests are in file order; "
                    "rates, per-minute error rates and trends through the run are not measured; rules are judged once "
                    "over the whole file (no time-based holds)")
