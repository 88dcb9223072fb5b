"""Harm: is anyone's objective broken, and do users pay for what a rule sees?

A shape (TTFT grows with prompt length, a heavy TPOT tail) is not harm by itself: prefill always
costs more for longer prompts. These signals say whether users are hurt, in two ways:

* **Objectives** (kvdoctor/objectives.py: stated with --slo or an SLO file, else the workload's
  defaults): ``*_over_objective`` is the worst measured/target over the objectives of that kind,
  above 1 when one is broken.
* **The capture's own baseline**, for what no objective names: a request *waits* for the part of
  its TTFT beyond what the unloaded server needs for its prompt (the engine's queue time where it
  reports one). Users pay when one request in ten waits at least as long as its own unloaded
  TTFT (waiting more than the work itself: the server is past the knee of its queueing curve) and
  at least one second (Nielsen's limit for a response that keeps a user's flow of thought: below
  it a delay is felt but does not interrupt). A stream *freezes* when one inter-token gap in a
  hundred lasts a second or more (the same limit, applied to a stream a user watches).

The ``*_harm`` signals combine both (1 = users are hurt). Rules name them under ``harm:``; a shape
rule whose harm does not hold is an observation (info), not an incident (docs/rules.md, "Harm").
"""
from __future__ import annotations

import numpy as np

from dataclasses import dataclass

from ..engines.rates import histogram_count_over
from ..numeric import binom_sf
from ..objectives import ERROR_RATE, LATENCY_OBJECTIVES, ROUTE_SEP
from .load import _baseline
from .outcomes import cut_at_limit
from .registry import percentile, signal

#: a delay a user notices as an interruption (Nielsen, Usability Engineering, 1993: 0.1 s feels
#: instant, 1 s keeps the flow of thought, 10 s keeps attention)
NOTICEABLE_S = 1.0
#: a request waits "as long as its own work" at P90: queueing theory's knee (waiting time equal to
#: service time is an M/D/1 server at ~2/3 utilisation; beyond it waits grow without bound)
WAIT_OVER_WORK = 1.0
MIN_REQUESTS = 5

#: the engine histogram (neutral name) each latency objective is read from without request records
ENGINE_HISTOGRAM = {"ttft": "ttft_seconds", "tpot": "tpot_seconds", "e2e": "e2e_seconds", "queue": "queue_seconds"}

#: objective kinds per harm symptom
KINDS = {"ttft": ("ttft", "queue"), "tpot": ("tpot", "itl"), "e2e": ("e2e",), "errors": (ERROR_RATE,)}


#: a breach is called when chance alone would put that many requests over the target less than one
#: time in twenty under an objective that holds exactly (one-sided binomial test): one slow request
#: in 24 is not a broken P99, four in 40 are
ALPHA = 0.05


def _kind(signal_name: str) -> str:
    """``ttft`` of ``ttft_p99_s`` (and of ``ttft_p99_s@/v1/completions``), or ``error_rate``."""
    signal_name = signal_name.partition(ROUTE_SEP)[0]
    return signal_name if signal_name == ERROR_RATE else signal_name.split("_")[0]


@dataclass(frozen=True)
class Reading:
    """One objective read on a window."""
    signal: str
    target: float
    measured: float
    #: requests (inter-token gaps, for ITL; failures, for the error rate) over the target, of ``total``
    over: int
    total: int
    #: the share of requests the objective lets be over target (1% for a P99; the rate itself for errors)
    budget: float
    #: error rate: how many of ``over`` are answers cut at the context limit (status 200)
    cut: int = 0

    @property
    def share_over(self) -> float:
        return self.over / self.total if self.total else np.nan

    @property
    def burn_rate(self) -> float:
        """Share over target over the share allowed: 1 spends the budget exactly; Google's SRE
        Workbook pages at 14.4 (a month's budget in two days)."""
        return self.share_over / self.budget if self.total and self.budget > 0 else np.nan

    @property
    def p_value(self) -> float:
        return binom_sf(self.over, self.total, self.budget) if self.total else np.nan

    @property
    def broken(self) -> bool:
        """Measured over target, and more requests over it than the objective's budget explains."""
        return bool(np.isfinite(self.measured) and self.measured > self.target and self.total
                    and self.share_over > self.budget and self.p_value < ALPHA)


def readings(w) -> list[Reading]:
    """Every objective of the window's capture (Prepared.slo: key -> target, the key a signal or
    SIGNAL@ROUTE) read on the window: a route's objective on that route's requests only."""
    got = w._cache.get("objective_readings")
    if got is not None:
        return got
    out = []
    for key, target in w.prep.slo.items():
        if not target > 0:
            continue
        sig, _, route = key.partition(ROUTE_SEP)
        kind = _kind(sig)
        mine = _route_mask(w, route) if route else None
        if kind == ERROR_RATE:
            # an answer the server stopped at the context limit is one the user did not get:
            # failed, as a refusal is (output-cut-at-context), though its status said 200
            failed = w.prep.is_error[w.req]
            cut = cut_at_limit(w)
            if cut is not None:
                failed = failed | cut
            failed = failed if mine is None else failed[mine]
            n_cut = 0 if cut is None else int((cut if mine is None else cut[mine]).sum())
            n = len(failed)
            out.append(Reading(key, target, float(failed.mean()) if n >= MIN_REQUESTS else np.nan,
                               int(failed.sum()) if n >= MIN_REQUESTS else 0, n if n >= MIN_REQUESTS else 0, target,
                               n_cut if n >= MIN_REQUESTS else 0))
            continue
        if kind not in LATENCY_OBJECTIVES:
            continue
        if kind == "itl":
            v = w.itl_values() if mine is None else np.array([])
            v = v if len(v) else w.r("itl_p99_s") if mine is None else w.r("itl_p99_s")[mine]
        else:
            v = w.r(LATENCY_OBJECTIVES[kind][1])
            v = v if mine is None else v[mine]
        v = v[np.isfinite(v)]
        total = len(v) if len(v) >= MIN_REQUESTS else 0
        q = int(sig.split("_")[1][1:])
        measured = w.value(sig) if mine is None else (float(np.percentile(v, q)) if total else np.nan)
        over = int((v > target).sum()) if total else 0
        if not total and mine is None and kind in ENGINE_HISTOGRAM:
            # no request records (a Prometheus range, a scrape alone): the engine's histogram
            # counts the requests over the target as its quantile reads the P99
            over_f, n = histogram_count_over(target, w.engine_hist(ENGINE_HISTOGRAM[kind]))
            if n >= MIN_REQUESTS and np.isfinite(over_f):
                over, total = int(round(over_f)), int(n)
        out.append(Reading(key, target, measured, over, total, 1 - q / 100))
    w._cache["objective_readings"] = out
    return out


def reading_of(key: str, target: float, values: np.ndarray) -> Reading:
    """A latency objective (``key``: its signal, e.g. ``tpot_p99_s``, with any ``@route``) read on
    these values: the percentile its name gives, how many are over target; unmeasured (NaN, none
    counted) below MIN_REQUESTS. For a what-if: the same objective on values a cause left out of."""
    v = values[np.isfinite(values)]
    q = int(key.partition(ROUTE_SEP)[0].split("_")[1][1:])
    if len(v) < MIN_REQUESTS:
        return Reading(key, target, np.nan, 0, 0, 1 - q / 100)
    return Reading(key, target, percentile(v, q), int((v > target).sum()), len(v), 1 - q / 100)


def _route_mask(w, route: str) -> np.ndarray:
    """Which of the window's requests were sent to ``route``."""
    codes, labels = w.prep.memoised("route_codes", lambda: _route_codes(w.prep))
    want = labels.index(route) if route in labels else -2
    return codes[w.req] == want


def _route_codes(prep) -> tuple[np.ndarray, list]:
    codes, labels = prep.cap.requests.codes("route")
    return codes[prep._order], list(labels)


def _worst(w, kinds: tuple[str, ...], what: str) -> float:
    vals = []
    for r in readings(w):
        if _kind(r.signal) not in kinds:
            continue
        v = (r.measured / r.target) if what == "over" else r.burn_rate if what == "burn" else float(r.broken)
        if np.isfinite(v):
            vals.append(v)
    return float(max(vals)) if vals else np.nan


def _over(w, kinds: tuple[str, ...]) -> float:
    """Worst measured/target over the window's objectives of these kinds; NaN when none is set
    or none could be measured."""
    return _worst(w, kinds, "over")


def _burn(w, kinds: tuple[str, ...]) -> float:
    return _worst(w, kinds, "burn")


def _breach(w, kinds: tuple[str, ...]) -> float:
    return _worst(w, kinds, "broken")


@signal("ttft_breach", "bool")
def ttft_breach(w):
    """1 when a TTFT (or queue-time) objective is broken: measured over target, with more requests
    over it than the objective's budget explains by chance (one-sided binomial, p < 0.05)."""
    return _breach(w, KINDS["ttft"])


@signal("tpot_breach", "bool")
def tpot_breach(w):
    """1 when a TPOT (or ITL) objective is broken (as ttft_breach)."""
    return _breach(w, KINDS["tpot"])


@signal("e2e_breach", "bool")
def e2e_breach(w):
    """1 when an end-to-end latency objective is broken (as ttft_breach)."""
    return _breach(w, KINDS["e2e"])


@signal("error_rate_breach", "bool")
def error_rate_breach(w):
    """1 when the error-rate objective is broken: more failures than its rate explains by chance."""
    return _breach(w, KINDS["errors"])


@signal("ttft_burn_rate", "x budget")
def ttft_burn(w):
    """Worst TTFT (or queue-time) objective's burn rate: share of requests over its target over the
    share it allows (a P99 allows 1%); above 1 the budget is being overspent."""
    return _burn(w, KINDS["ttft"])


@signal("tpot_burn_rate", "x budget")
def tpot_burn(w):
    """Worst TPOT (or ITL) objective's burn rate: share of requests (gaps) over target over the share allowed."""
    return _burn(w, KINDS["tpot"])


@signal("e2e_burn_rate", "x budget")
def e2e_burn(w):
    """End-to-end latency objective's burn rate."""
    return _burn(w, KINDS["e2e"])


@signal("error_rate_burn_rate", "x budget")
def errors_burn(w):
    """Error-rate objective's burn rate: the error rate over the rate the objective allows."""
    return _burn(w, KINDS["errors"])


@signal("ttft_over_objective", "ratio")
def ttft_over_objective(w):
    """Worst TTFT (and queue-time) objective: measured percentile over its target (above 1: over)."""
    return _over(w, KINDS["ttft"])


@signal("tpot_over_objective", "ratio")
def tpot_over_objective(w):
    """Worst TPOT (and ITL) objective: measured percentile over its target (above 1: over)."""
    return _over(w, KINDS["tpot"])


@signal("e2e_over_objective", "ratio")
def e2e_over_objective(w):
    """Worst end-to-end latency objective: measured percentile over its target (above 1: over)."""
    return _over(w, KINDS["e2e"])


@signal("error_rate_over_objective", "ratio")
def error_rate_over_objective(w):
    """Error rate over its objective (above 1: over)."""
    return _over(w, KINDS["errors"])


@signal("latency_over_objective", "ratio")
def latency_over_objective(w):
    """Worst latency objective of any kind (TTFT, TPOT, ITL, E2E, queue): above 1 one is over."""
    return _over(w, ("ttft", "queue", "tpot", "itl", "e2e"))


def _unloaded(prep, prompt: np.ndarray) -> np.ndarray:
    """TTFT on the unloaded server for prompts of these lengths: the prompt at the low-load prefill
    speed, and never under the least-loaded requests' median TTFT (the fixed cost every request pays)."""
    base = _baseline(prep)
    cost, floor = base.get("prefill_s_per_token", np.nan), base.get("ttft_s", np.nan)
    exp = np.maximum(prompt * cost, 0.0)
    if np.isfinite(floor):
        exp = np.where(np.isfinite(exp), np.maximum(exp, floor), floor)
    return exp


def request_waits(prep, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(wait, unloaded TTFT) of requests lo..hi-1 in arrival order (NaN where unknown): the engine's
    queue time where it reports one, else TTFT beyond the unloaded TTFT of the same prompt."""
    ttft, queue = prep.col["ttft_s"][lo:hi], prep.col["queue_s"][lo:hi]
    unloaded = _unloaded(prep, prep.col["prompt_tokens"][lo:hi])
    return np.where(np.isfinite(queue), queue, np.maximum(ttft - unloaded, 0.0)), unloaded


def _unloaded_ttft(w) -> np.ndarray:
    return _unloaded(w.prep, w.r("prompt_tokens"))


def _waits(w) -> tuple[np.ndarray, np.ndarray]:
    """(wait, unloaded TTFT) per request of the window with both known."""
    key = "harm_waits"
    got = w._cache.get(key)
    if got is None:
        wait, unloaded = request_waits(w.prep, w.req.start, w.req.stop)
        m = np.isfinite(wait) & np.isfinite(unloaded) & np.isfinite(w.r("ttft_s"))
        got = w._cache[key] = (wait[m], unloaded[m])
    return got


@signal("ttft_wait_p90_s", "s")
def ttft_wait_p90(w):
    """P90 of each request's wait: its TTFT beyond what the unloaded server takes for its prompt
    (the engine's queue time where reported)."""
    wait, _ = _waits(w)
    return percentile(wait, 90, MIN_REQUESTS)


@signal("ttft_unloaded_p90_s", "s")
def ttft_unloaded_p90(w):
    """P90 of each request's unloaded TTFT (its prompt at the low-load prefill speed): the work
    itself, which no queueing fix removes."""
    _, unloaded = _waits(w)
    return percentile(unloaded, 90, MIN_REQUESTS)


@signal("ttft_harm", "bool")
def ttft_harm(w):
    """1 when first tokens hurt users: a TTFT objective is broken, or one request in ten waits
    (beyond its own prefill) at least a second and at least as long as its unloaded TTFT."""
    over = w.value("ttft_breach")
    if over == 1:
        return 1.0
    wait, unloaded = w.value("ttft_wait_p90_s"), w.value("ttft_unloaded_p90_s")
    if np.isfinite(wait) and np.isfinite(unloaded):
        return float(wait >= NOTICEABLE_S and wait >= WAIT_OVER_WORK * unloaded)
    if any(r.total for r in readings(w) if _kind(r.signal) in KINDS["ttft"]):
        return 0.0
    # no latency measured at all (llama.cpp's gauges alone, from Prometheus): the engine's queue
    # over its running batch says how long a request waits against its own service time
    queued = w.value("engine_wait_over_work")
    return float(queued >= WAIT_OVER_WORK) if np.isfinite(queued) else np.nan


@signal("engine_wait_over_work", "ratio")
def engine_wait_over_work(w):
    """Median over the window's scrapes of the engine's waiting queue over its running batch:
    by Little's law (L = rate x time, the same arrival rate through both) the mean time a request
    waits over the mean time it is served. At 1 a request waits as long as its own work (the knee
    of the queueing curve, as ttft_harm's WAIT_OVER_WORK); read only where no latency is measured."""
    # requests_waiting is llama.cpp's requests_deferred where it has no other (engines.neutral.derive)
    _, running = w.engine("requests_running")
    _, waiting = w.engine("requests_waiting")
    if len(running) != len(waiting):  # one of them never scraped
        return np.nan
    m = np.isfinite(running) & np.isfinite(waiting) & (running > 0)
    if m.sum() < 3:
        return np.nan
    return float(np.median(waiting[m] / running[m]))


@signal("tpot_harm", "bool")
def tpot_harm(w):
    """1 when decoding hurts users: a TPOT or ITL objective is broken, or streams freeze (one
    inter-token gap in a hundred lasts a second or more)."""
    over = w.value("tpot_breach")
    if over == 1:
        return 1.0
    itl = w.value("itl_p99_s")
    if np.isfinite(itl):
        return float(itl >= NOTICEABLE_S)
    return 0.0 if np.isfinite(over) else np.nan


@signal("latency_harm", "bool")
def latency_harm(w):
    """1 when any latency hurts users: TTFT or decode harm, or an end-to-end objective broken."""
    parts = [w.value("ttft_harm"), w.value("tpot_harm"), w.value("e2e_breach")]
    parts = [float(p) for p in parts if np.isfinite(p)]
    return float(max(parts)) if parts else np.nan


@signal("objective_breached", "bool")
def objective_breached(w):
    """1 when any objective (latency or error rate) is broken in the window."""
    return _breach(w, ("ttft", "queue", "tpot", "itl", "e2e", ERROR_RATE))


def _slow_requests(w):
    """(wait, unloaded TTFT) of the requests over the TTFT objective with the worst burn rate,
    or None without one (queue-time objectives judge queue time itself: not split here)."""
    worst = None
    for r in readings(w):
        if _kind(r.signal) == "ttft" and r.total and (worst is None or r.burn_rate > worst.burn_rate):
            worst = r
    if worst is None:
        return None
    ttft = w.r("ttft_s")
    unloaded = _unloaded_ttft(w)
    queue = w.r("queue_s")
    slow = np.isfinite(ttft) & (ttft > worst.target) & np.isfinite(unloaded)
    if not slow.any():
        return None
    wait = np.where(np.isfinite(queue), queue, np.maximum(ttft - unloaded, 0.0))[slow]
    return wait, unloaded[slow], ttft[slow], worst.target


@signal("ttft_slow_wait_share", "fraction")
def ttft_slow_wait_share(w):
    """Over the requests whose TTFT broke the objective: the median share of their TTFT spent
    waiting (beyond the unloaded TTFT of their prompt, or the engine's queue time)."""
    got = _slow_requests(w)
    if got is None:
        return np.nan
    wait, _, ttft, _ = got
    return float(np.median(np.clip(wait / np.where(ttft > 0, ttft, np.nan), 0, 1)))


@signal("ttft_slow_prefill_frac", "fraction")
def ttft_slow_prefill_frac(w):
    """Over the requests whose TTFT broke the objective: the share whose prompt alone, prefilled
    on the unloaded server, would already take longer than the target."""
    got = _slow_requests(w)
    if got is None:
        return np.nan
    _, unloaded, _, target = got
    return float(np.mean(unloaded > target))


@signal("objective_defaults_only", "bool")
def objective_defaults_only(w):
    """1 when every objective broken in the window is a workload default (none stated with --slo
    or an SLO file): the verdict then rests on published practice, not the service's own target."""
    broken = [r for r in readings(w) if r.broken]
    if not broken:
        return np.nan
    return float(all(r.signal not in w.prep.stated for r in broken))  # r.signal: the objective's key
