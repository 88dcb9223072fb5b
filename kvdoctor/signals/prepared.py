"""The per-capture work signals share, done once.

:class:`Prepared` sorts a capture by arrival and derives the per-request columns signals share
(concurrency at arrival, mean decode concurrency, achievable prefix hits, error classes, the
read-late burst mask); a :class:`~kvdoctor.signals.window.Window` is then a cheap index range
into it, so evaluating hundreds of rolling windows costs little.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import error_classes
from ..capture import Capture
from .arrays import is_sorted
from .series import gpu_from_engine
from .window import Window


REQUEST_COLUMNS = ("arrival_s", "first_token_s", "finish_s", "ttft_s", "tpot_s", "e2e_s", "queue_s", "prefill_s", "decode_s",
                   "itl_p50_s", "itl_p99_s", "itl_max_s", "prompt_tokens", "output_tokens",
                   "cached_prompt_tokens", "turn", "output_repetition", "http_status",
                   "baseline_agreement_frac", "baseline_output_repetition",
                   "baseline_forced_agreement_frac")


#: windows Prepared.window keeps (the rolling ones only pass through)
RECENT_WINDOWS = 4

#: an inter-chunk gap below this is a reading artefact, not a decode step (see Prepared._read_late)
READ_BURST_S = 0.001
READ_BURST_MIN_GAPS = 3


class Prepared:
    """A capture sorted by time with the per-request columns signals share."""

    def __init__(self, cap: Capture, slo: dict[str, float] | None = None, stated: frozenset[str] | set[str] = frozenset()):
        self.cap = cap
        self.meta = cap.meta
        #: per-capture results signals compute once (baselines, the effective configuration, ...):
        #: one memo, keyed by what each module computes, instead of attributes hung on this object
        self.memo: dict[str, Any] = {}
        #: the objectives judged: signal -> target (kvdoctor/objectives.py); ``stated``: those the
        #: user gave (--slo, an SLO file), the rest are the workload's defaults
        self.slo = dict(slo or {})
        self.stated = frozenset(stated)
        req = cap.requests
        t = req.num("arrival_s")
        if np.all(np.isnan(t)):
            t = req.num("finish_s")
        #: False when the source had no send or finish times (llmperf files): the request index
        #: then stands in for time so windows still work, but rates and anything "per minute" or
        #: "through the run" are unknown (Window.duration_s is NaN)
        self.arrivals_known = len(req) == 0 or (bool(np.isfinite(t).any())
                                                and getattr(cap.meta, "arrivals_known", None) is not False)
        if np.all(np.isnan(t)):  # no times at all (e.g. a benchmark summary): one window, in file order
            t = np.arange(len(req), dtype=float)
        keyed = np.where(np.isnan(t), np.inf, t)
        if is_sorted(keyed):
            order = np.arange(len(t))  # already in arrival order (the usual case): no gathers
            self.t = t
            self.col = {name: req.num(name) for name in REQUEST_COLUMNS}
        else:
            order = np.argsort(keyed, kind="stable")
            self.t = t[order]
            self.col = {name: req.num(name)[order] for name in REQUEST_COLUMNS}
        #: each request's error class (kvdoctor/error_classes.py) as a code into CLASS_NAMES, 0 for a success
        self.error_code = _error_classes(req)[order]
        # a request the client gave up on, or one a benchmark client merely flagged, is not a
        # server failure (its latency still counts); "in-flight" rows are the live window's
        # requests not answered yet
        self.is_error = np.isin(self.error_code, class_codes(*(c for c, e in error_classes.CLASSES.items() if e.failure)))
        self.is_rejected = self.is_error & np.isin(self.error_code, class_codes("rate_limited", "context_overflow", "overloaded"))
        self.is_context_error = self.error_code == CLASS_NAMES.index("context_overflow")
        self.col["context_tokens"] = self.col["prompt_tokens"] + np.nan_to_num(self.col["output_tokens"])
        fin = self.col["finish_s"]
        # finishes in time order (nearly sorted already: timsort is fast), shared by both below
        keyed_fin = np.where(np.isnan(fin), np.inf, fin)
        self._fin_order = np.argsort(keyed_fin, kind="stable")
        self._fin_sorted = keyed_fin[self._fin_order]
        self.col["concurrency"] = self._concurrency_at_arrival()
        self.col["decode_concurrency"] = self._mean_in_flight_decoding()
        self._order = order
        self._session: np.ndarray | None = None
        #: where no request says its conversation and turn but prompts carry block hashes, both are
        #: inferred from the prefix chains on first use (conversations.py): most clients send no
        #: session id, yet each turn's prompt extends the previous one
        self.turns_inferred = False
        if not np.isfinite(self.col["turn"]).any() and len(order) and req.lists("prefix_block_hashes") is not None:
            del self.col["turn"]
        self.itl = self._itl_lists(req, order)
        #: streams the recorder read in bursts (most gaps under READ_BURST_S): its own process
        #: was starved, so their decode timings are the reader's, not the engine's, and are unknown
        self.read_late = self._read_late()
        if self.read_late.any():
            for name in ("tpot_s", "itl_p50_s", "itl_p99_s", "itl_max_s"):
                self.col[name] = np.where(self.read_late, np.nan, self.col[name])
        self.gpu = cap.gpu if len(cap.gpu) else gpu_from_engine(cap)
        self.gpu_t = self.gpu.num("time_s")
        self.host_t = cap.host.num("time_s")
        self.engine_t = cap.engine.time_s
        self.events = sorted(cap.events, key=lambda e: e.get("time_s", 0.0))
        self.event_t = np.array([e.get("time_s", np.nan) for e in self.events], dtype=float)
        self.config = self._config()

    def memoised(self, key: str, build: Callable[[], Any]) -> Any:
        """``memo[key]``, made by ``build()`` on first use (a None result is kept too): how a
        signal module computes a per-capture result once."""
        try:
            return self.memo[key]
        except KeyError:
            got = self.memo[key] = build()
            return got

    @property
    def error_class(self) -> np.ndarray:
        """Each request's error class name ("" for a success), in arrival order."""
        return np.array(CLASS_NAMES, dtype=object)[self.error_code]

    def hist_times(self, name: str) -> np.ndarray | None:
        """Times of an engine histogram's snapshots when sorted (as the capture reader gives
        them), else None."""
        def build():
            t = np.array([t for t, _ in self.cap.engine.histograms.get(name, ())], dtype=float)
            return t if is_sorted(t) else None

        return self.memoised(f"hist_times:{name}", build)

    # -- per-capture derived columns ----------------------------------------------------
    def _concurrency_at_arrival(self) -> np.ndarray:
        """Requests in flight when each request arrived (itself included)."""
        arr = self.t
        fin = self.col["finish_s"]
        if np.all(np.isnan(fin)):
            return np.full(len(arr), np.nan)
        fin_sorted = self._fin_sorted
        # arr is sorted: requests started by arr[i] = 1 + index of the last arrival tied with it
        n = len(arr)
        last_of_tie = np.append(np.flatnonzero(arr[1:] != arr[:-1]), n - 1)
        started = np.repeat(last_of_tie + 1, np.diff(np.append(-1, last_of_tie)))
        finished = np.searchsorted(fin_sorted, arr, side="right")
        return (started - finished).astype(float)

    def _in_flight_steps(self) -> tuple[np.ndarray, ...] | None:
        """(arrivals, finishes, and the prefix sums of each with a leading 0) of the requests with
        both times, each sorted: the in-flight step function, built once per capture; None with
        fewer than 2 such arrivals or no finish."""
        def build():
            done = np.isfinite(self.t) & np.isfinite(self.col["finish_s"])
            arr = self.t[done]  # a subset of a sorted array stays sorted
            fin = self._fin_sorted[np.isfinite(self._fin_sorted)]
            if len(arr) < 2 or len(fin) < 1:
                return None
            return arr, fin, np.concatenate([[0.0], np.cumsum(arr)]), np.concatenate([[0.0], np.cumsum(fin)])

        return self.memoised("in_flight_steps", build)

    def mean_in_flight(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Mean number of requests in flight over each interval [a, b], from the cumulative
        area under the in-flight step function: with arrivals and finishes each sorted,
        area(t) = t * (started - finished) - (sum of those arrivals - sum of those finishes),
        read off prefix sums with searchsorted (no loops, no merge of the two event lists; the
        prefix sums are made once per capture, so a window's interval costs two lookups)."""
        steps = self._in_flight_steps()
        if steps is None:
            return np.full(len(a), np.nan)
        arr, fin, cs_a, cs_f = steps

        def area(t: np.ndarray) -> np.ndarray:
            na = np.searchsorted(arr, t, side="right")
            nf = np.searchsorted(fin, t, side="right")
            return t * (na - nf) - (cs_a[na] - cs_f[nf])

        span = b - a
        good = np.isfinite(a) & np.isfinite(b) & (span > 0)
        out = np.full(len(a), np.nan)
        out[good] = (area(b[good]) - area(a[good])) / span[good]
        return out

    def _mean_in_flight_decoding(self) -> np.ndarray:
        """mean_in_flight(first token, finish) of every request, the same numbers by fewer lookups:
        at its own finish, the finishes up to it are its place in the sorted finishes (the end of
        its run of equal ones), and the arrivals up to it are looked up in finish order, where the
        lookups run in order (a random one costs twice a sorted one on a million requests)."""
        a, b = self.col["first_token_s"], self.col["finish_s"]
        steps = self._in_flight_steps()
        if steps is None:
            return np.full(len(a), np.nan)
        arr, fin, cs_a, cs_f = steps

        def area(t: np.ndarray, na: np.ndarray, nf: np.ndarray) -> np.ndarray:
            return t * (na - nf) - (cs_a[na] - cs_f[nf])

        n_fin = len(fin)
        by_fin = self._fin_order[np.isfinite(self._fin_sorted)]  # the requests of ``fin``, in its order
        last_of_run = np.append(np.flatnonzero(fin[1:] != fin[:-1]), n_fin - 1)
        nf_b = np.empty(len(b), dtype=np.int64)
        nf_b[by_fin] = np.repeat(last_of_run + 1, np.diff(np.append(-1, last_of_run)))
        na_b = np.empty(len(b), dtype=np.int64)
        na_b[by_fin] = np.searchsorted(arr, fin, side="right")
        span = b - a
        good = np.isfinite(a) & np.isfinite(b) & (span > 0)
        a_g = a[good]
        na_a, nf_a = np.searchsorted(arr, a_g, side="right"), np.searchsorted(fin, a_g, side="right")
        out = np.full(len(a), np.nan)
        out[good] = (area(b[good], na_b[good], nf_b[good]) - area(a_g, na_a, nf_a)) / span[good]
        return out

    def _achievable_cached(self, req, order: np.ndarray) -> np.ndarray:
        """Prompt tokens an ideal prefix cache would have served: the leading blocks whose
        hash an earlier request (in arrival order) already produced. Block ids chain the
        prefix, so an equal id means an equal prefix up to that block."""
        n = len(order)
        lists = req.lists("prefix_block_hashes")
        if lists is None or n == 0:
            return np.full(n, np.nan)
        offsets, values = lists
        lengths = np.diff(offsets)  # file order
        vals = values[offsets[0]:offsets[-1]]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        owner_rank = np.repeat(rank, lengths)
        inverse = np.unique(vals, return_inverse=True)[1].ravel()
        first_rank = np.full(int(inverse.max()) + 1 if len(inverse) else 0, np.iinfo(np.int64).max)
        np.minimum.at(first_rank, inverse, owner_rank)
        hit = first_rank[inverse] < owner_rank
        seg_start = np.cumsum(lengths) - lengths
        pos = np.arange(len(vals)) - np.repeat(seg_start, lengths)
        miss_pos = np.where(hit, np.iinfo(np.int64).max, pos)
        lead = np.zeros(n, dtype=np.int64)
        has = lengths > 0
        if has.any():
            lead[has] = np.minimum(np.minimum.reduceat(miss_pos, seg_start[has]), lengths[has])
        block_tokens = req.num("prefix_block_tokens")
        cached = lead * block_tokens
        prompt = req.num("prompt_tokens")
        cached = np.where(np.isnan(prompt), cached, np.minimum(cached, prompt))
        cached[~has] = np.nan
        return cached[order]

    def _read_late(self) -> np.ndarray:
        """Per request in arrival order: True when more than half of its inter-chunk gaps (at
        least READ_BURST_MIN_GAPS) are under READ_BURST_S. No engine emits streamed tokens that
        fast one chunk each (a decode step is milliseconds even for a tiny model on an H200);
        gaps that short mean the chunks sat in a socket buffer until a starved reader (the
        proxy, or a benchmark client) got a core, and were stamped together."""
        n = len(self.t)
        if self.itl is None or n == 0:
            return np.zeros(n, dtype=bool)
        offsets, values, order = self.itl
        counts = np.diff(offsets)
        short = np.concatenate(([0], np.cumsum(values < READ_BURST_S)))[offsets]
        late = (counts >= READ_BURST_MIN_GAPS) & (np.diff(short) > counts / 2)
        return late[order]

    def _itl_lists(self, req, order: np.ndarray):
        lists = req.lists("itl_s")
        if lists is None:
            return None
        offsets, values = lists
        return offsets, values, order

    def _config(self) -> dict[str, Any]:
        cfg = dict(self.meta.config or {})
        for e in self.events:
            if e.get("kind") == "config":
                cfg.update(e.get("detail") or {})
        return cfg

    @property
    def session(self) -> np.ndarray:
        """Conversation ids as int codes in arrival order (-1 unknown); built on first use
        (inferred from prompt prefix chains where no request names its conversation)."""
        if self._session is None:
            if "turn" not in self.col:
                self.column("turn")
            else:
                self._session = self.cap.requests.codes("session_id")[0][self._order]
        return self._session

    @property
    def request_ids(self) -> np.ndarray:
        """Request ids (an object array) in arrival order."""
        return np.asarray(self.cap.requests.strings("request_id"), dtype=object)[self._order]

    def column(self, name: str) -> np.ndarray:
        col = self.col.get(name)
        if col is None and name == "achievable_cached_tokens":  # costly: only when a rule asks
            col = self.col[name] = self._achievable_cached(self.cap.requests, self._order)
        if col is None and name == "turn":  # no turns recorded: from the prefix chains, on first use
            from .conversations import infer_conversations

            session, turn = infer_conversations(self.cap.requests, self._order)
            self._session, col = session, turn
            self.col["turn"] = turn
            self.turns_inferred = bool((session >= 0).any())
        if col is None:
            raise KeyError(name)
        return col

    # -- windows ------------------------------------------------------------------------
    @property
    def start_s(self) -> float:
        cands = [a[np.isfinite(a)].min() for a in (self.t, self.gpu_t, self.host_t, self.engine_t) if np.isfinite(a).any()]
        return float(min(cands)) if cands else 0.0

    @property
    def end_s(self) -> float:
        fin = self.col["finish_s"]
        cands = [a[np.isfinite(a)].max() for a in (self.t, fin, self.gpu_t, self.host_t, self.engine_t) if np.isfinite(a).any()]
        return float(max(cands)) if cands else 0.0

    def window(self, t0: float, t1: float) -> "Window":
        """The window over [t0, t1]. The last few asked for are kept, so callers that read the same
        span (the whole capture: coverage, key numbers, an incident over all of it, the report's
        charts) share its memoised signals instead of computing them on a million requests again."""
        recent = self.memo.setdefault("windows", {})
        w = recent.get((t0, t1))
        if w is None:
            if len(recent) >= RECENT_WINDOWS:
                del recent[next(iter(recent))]  # the oldest
            w = recent[(t0, t1)] = Window(self, t0, t1)
        return w


#: error classes by code (Prepared.error_code); 0 is a success
CLASS_NAMES = ("", *error_classes.CLASSES)


def class_codes(*names: str) -> list[int]:
    return [CLASS_NAMES.index(n) for n in names]


def _error_classes(req) -> np.ndarray:
    """Error class code (CLASS_NAMES) per request in file order, classifying each distinct
    (status, HTTP status, error text) once: a big capture has few distinct error texts."""
    n = len(req)
    if n == 0:
        return np.array([], dtype=np.int8)
    s_codes, s_labels = req.codes("status")
    e_codes, e_labels = req.codes("error")
    http = req.num("http_status")
    # one int64 key per row (np.unique over rows of a 2-D array is ~100x slower)
    h = np.where(np.isfinite(http) & (http >= 0) & (http < 1000), http, -1).astype(np.int64) + 1
    n_err = len(e_labels) + 1
    key = ((s_codes.astype(np.int64) + 1) * n_err + (e_codes.astype(np.int64) + 1)) * 1001 + h
    key_max = int(key.max())
    if key_max < MAX_DENSE_KEYS:  # the usual few statuses and error texts: a mark per key, no sort
        present = np.zeros(key_max + 1, dtype=bool)
        present[key] = True
        uniq = np.flatnonzero(present)
    else:
        uniq, inverse = np.unique(key, return_inverse=True)
    s_labels, e_labels = list(s_labels) + [None], list(e_labels) + [None]
    names = []
    for k in uniq.tolist():
        rest, code = divmod(k, 1001)
        s, e = divmod(rest, n_err)
        st, err = s_labels[s - 1], e_labels[e - 1]
        names.append(error_classes.classify(code - 1 if code else None, None, err, st or ("error" if err else "ok")) or "")
    codes = np.array([CLASS_NAMES.index(x) for x in names], dtype=np.int8)
    if key_max < MAX_DENSE_KEYS:
        by_key = np.zeros(key_max + 1, dtype=np.int8)
        by_key[uniq] = codes
        return by_key[key]
    return codes[inverse.ravel()]


#: _error_classes maps (status, error text, HTTP status) keys below this through a table, one
#: byte a key (else through np.unique's sort)
MAX_DENSE_KEYS = 1 << 24
