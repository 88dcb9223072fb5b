"""Windows over a capture: the unit that signals are computed on.

A :class:`Window` is a cheap index range into a :class:`~kvdoctor.signals.prepared.Prepared`
capture (requests that arrived in it, samples taken in it) with column access, percentiles,
fits and engine/GPU/host series; signal values are memoised per window.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import is_sorted
from .quantiles import Ranked
from .registry import FIT_MIN_X_SPREAD_FRAC, REGISTRY, fit, split_medians
from .series import tpot_steps


def _range(t: np.ndarray, t0: float, t1: float) -> slice:
    return slice(int(np.searchsorted(t, t0, side="left")), int(np.searchsorted(t, t1, side="right")))


class Window:
    """Requests that arrived in [t0, t1] and samples taken in it; signal values are memoised."""

    def __init__(self, prep: Any, t0: float, t1: float):  # prep: the Prepared capture that made this window
        self.prep = prep
        self.t0, self.t1 = t0, t1
        self.req = _range(prep.t, t0, t1)
        self.gpu = _range(prep.gpu_t, t0, t1) if is_sorted(prep.gpu_t) else None
        self.host = _range(prep.host_t, t0, t1) if is_sorted(prep.host_t) else None
        self.eng = _range(prep.engine_t, t0, t1)
        self.ev = _range(prep.event_t, t0, t1)
        self._memo: dict[str, float] = {}
        self._cache: dict[str, tuple[float, float, int]] = {}

    @property
    def duration_s(self) -> float:
        """Seconds the window spans; NaN when the capture has no times (see Prepared.arrivals_known)."""
        if not self.prep.arrivals_known and not (len(self.prep.engine_t) or len(self.prep.gpu_t)):
            return float("nan")
        return max(self.t1 - self.t0, 0.0)

    @property
    def n_requests(self) -> int:
        return self.req.stop - self.req.start

    def r(self, name: str) -> np.ndarray:
        """A request column within the window (a view, not a copy)."""
        return self.prep.column(name)[self.req]

    def gpu_col(self, name: str) -> np.ndarray:
        arr = self.prep.gpu.num(name)
        return arr[self.gpu] if self.gpu is not None else arr[(self.prep.gpu_t >= self.t0) & (self.prep.gpu_t <= self.t1)]

    def host_col(self, name: str) -> np.ndarray:
        arr = self.prep.cap.host.num(name)
        return arr[self.host] if self.host is not None else arr[(self.prep.host_t >= self.t0) & (self.prep.host_t <= self.t1)]

    def engine(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        v = self.prep.cap.engine.get(name)
        if v is None:
            return self.prep.engine_t[:0], np.array([])
        return self.prep.engine_t[self.eng], v[self.eng]

    def engine_quantile(self, name: str, q: float) -> float:
        """Quantile of an engine histogram over the window (Prometheus histogram_quantile of
        the increase between the window's first and last scrape)."""
        d = self.engine_hist(name)
        if not d or not d.get("count"):
            return float("nan")
        from ..engines.rates import histogram_quantile

        return histogram_quantile(q, None, d)

    def engine_hist(self, name: str) -> dict | None:
        """The observations of an engine histogram over the window (the increase between the
        window's first and last scrape, histogram_delta's dict), None without that histogram."""
        rows = self.prep.cap.engine.histograms.get(name)
        if not rows:
            return None
        key = f"hist:{name}"
        if key not in self._cache:
            from ..engines.rates import window_histograms

            # rows are in time order: hand over only the last snapshot at or before t0 and
            # those inside the window (each window would otherwise scan the whole capture)
            times = self.prep.hist_times(name)
            if times is not None:
                i1 = int(np.searchsorted(times, self.t1, side="right"))
                i0 = max(int(np.searchsorted(times, self.t0, side="right")) - 1, 0)
                rows = rows[i0:i1]
            self._cache[key] = window_histograms({name: rows}, self.t0, self.t1).get(name)
        return self._cache[key]

    def engine_tpot_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """(requests running, TPOT) per interval between consecutive engine samples in the
        window, for captures without request records (Prometheus, a scrape alone): TPOT from
        the decode-seconds / generated-tokens counters (llama.cpp), else the interval's median
        of the TPOT histogram. The engine-side stand-in for per-request decode concurrency."""
        key = "tpot_steps"
        if key not in self._cache:
            self._cache[key] = self._tpot_steps()
        return self._cache[key]

    def _tpot_steps(self) -> tuple[np.ndarray, np.ndarray]:
        t, running = self.engine("requests_running")
        _, secs = self.engine("decode_seconds_total")
        _, toks = self.engine("generation_tokens_total")
        return tpot_steps(t, running, secs, toks, self.prep.cap.engine.histograms.get("tpot_seconds"))

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        evs = self.prep.events[self.ev]
        return [e for e in evs if kind is None or e.get("kind") == kind]

    def itl_values(self) -> np.ndarray:
        """Every inter-token gap of the window's requests (streams read in bursts left out), in
        arrival order; gathered at once and kept for the window's later callers."""
        got = self._cache.get("itl_values")
        if got is None:
            got = self._cache["itl_values"] = self._itl_values()
        return got

    def _itl_values(self) -> np.ndarray:
        if self.prep.itl is None:
            return np.array([])
        offsets, values, order = self.prep.itl
        rows = order[self.req][~self.prep.read_late[self.req]]
        if len(rows) == 0:
            return np.array([])
        starts = offsets[rows]
        lengths = offsets[rows + 1] - starts
        # each row's gaps in turn: position within the concatenation minus where the row starts in it
        return values[np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))]

    def pct(self, column: str, q: float, min_n: int = 1) -> float:
        """Percentile (numpy's linear method) of a request column's known values; each column is
        partitioned only as far as the percentiles asked of it need (quantiles.Ranked), once per window."""
        key = f"ranked:{column}"
        s = self._cache.get(key)
        if s is None:
            a = self.r(column)
            s = self._cache[key] = Ranked(a[~np.isnan(a)])
        if len(s) < max(min_n, 1):
            return float("nan")
        return s.percentile(q)

    def medians_by(self, key: str, value: str, lo_q: float = 25, hi_q: float = 75,
                   min_n: int = 8) -> tuple[float, float]:
        """Median of ``value`` where ``key`` is at or above its ``hi_q`` percentile, and where
        it is at or below its ``lo_q`` percentile (e.g. TTFT of long vs short prompts)."""
        return split_medians(self.r(key), self.r(value), lo_q, hi_q, min_n)

    def fit(self, x: str, y: str) -> tuple[float, float, int]:
        """fit() of two request columns, memoised (slope and correlation signals share it)."""
        key = f"fit:{x}:{y}"
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = fit(self.r(x), self.r(y), min_spread_frac=FIT_MIN_X_SPREAD_FRAC)
        return hit

    def value(self, name: str) -> float:
        v = self._memo.get(name)
        if v is None:
            v = REGISTRY[name].fn(self)
            v = float("nan") if v is None else float(v)
            self._memo[name] = v
            if v == v:  # known: coverage asks "known in any window?" before computing on the whole capture
                self.prep.memo.setdefault("known_signals", set()).add(name)
        return v
