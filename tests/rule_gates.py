"""Whether a rule *could* fire on a capture, whatever its thresholds: the gates a rule passes
before any threshold is compared, checked on the very windows `diagnose` evaluates.

A rule is active on a window only where (``diagnosis/evaluate.match``) the window holds at least
``symptom.min_requests`` requests, its symptom condition is true and one of its causes holds; it
fires once active for its ``for:`` time over consecutive evaluations. A condition whose every
branch needs a signal that is unknown on the window (NaN: no such source, too few samples, an
objective not given) is never true, whatever the params say (``conditions.can_hold``). So a rule
*could* fire on a capture when some run of consecutive windows, each with enough requests, a
symptom that can hold and a cause that can hold, lasts its ``for:`` time (or, on a capture one
window covers, when an objective of its symptom could break beside it). Where none does, a
must-not-fire case on that capture proves nothing: the rule is silent by construction.
"""
from __future__ import annotations

from kvdoctor.diagnosis import conditions as C
from kvdoctor.diagnosis.evaluate import step_times


def _window_gate(rule, w, slo) -> str | None:
    """None where the rule can be active on window w for some thresholds, else why not."""
    if w.n_requests < rule.min_requests:
        return f"{w.n_requests} requests, under its min_requests {rule.min_requests}"
    if not C.can_hold(rule.when, w.value, slo):
        lack = sorted({s for s in rule.when.signals() if _nan(w.value(s))})
        return "symptom cannot hold: unknown " + (", ".join(lack) or "objective (slo.*) not given")
    if not any(c.when is None or C.can_hold(c.when, w.value, slo) for c in rule.causes):
        return "no cause can hold"
    return None


def _objective_symptoms() -> set[str]:
    from kvdoctor.diagnosis import load_rules

    return {r.symptom for r in load_rules() if r.kind == "objective"}


def _nan(x: float) -> bool:
    return x != x


def could_fire(rule, diag) -> str | None:
    """None where `rule` could fire on the diagnosed capture for some thresholds; else the
    reason it cannot (the gate that failed on the most windows)."""
    prep, opt = diag.prepared, diag.options
    slo = opt.targets
    times, step, lookback = step_times(prep.start_s, prep.end_s, opt)
    if not prep.arrivals_known:  # one window over the whole file, no time-based hold (as evaluate.activations)
        w = prep.window(prep.start_s, prep.end_s)
        return _window_gate(rule, w, slo)
    reasons: dict[str, int] = {}
    run_start = None
    for t in times:
        why = _window_gate(rule, prep.window(t - lookback, t), slo)
        if why is None:
            fresh = max(t - lookback, t - step) if len(times) > 1 else t - lookback
            run_start = fresh if run_start is None else run_start
            if t - run_start >= rule.for_s:
                return None
        else:
            run_start = None
            reasons[why] = reasons.get(why, 0) + 1
    if not reasons:
        # one window, shorter than the hold: the run still fires beside a broken objective of its
        # symptom (evaluate.activations), and an objective is a threshold too
        if len(times) == 1 and rule.symptom in _objective_symptoms():
            return None
        return f"no run of windows lasts its for: {rule.for_s:g} s"
    return max(reasons, key=reasons.get)
