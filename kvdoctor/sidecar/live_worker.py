"""The live diagnosis in a process of its own, fed the records that arrived since its last step.

In a thread, a step (build a capture of the recent past, compute the signals, match the rules)
holds the GIL the proxy relays with for most of its run: every stream that has a chunk to pass
waits for it, which is added TTFT and ITL measured on the clients (benchmarks/bench_proxy.py).
The worker keeps its own copy of the recent past and the :class:`LiveDiagnoser` with its hold
state; the agent sends it only what is new, and gets back what to announce and export.

The agent's copy (to start a new worker from) holds each record pickled once, as it arrives: bytes
the cyclic garbage collector never visits. As objects (a record, its ITL and prefix-hash lists)
the lookback plus the longest hold (16 minutes: ~300,000 requests at an H200's rates) were
traversed by every full collection on the relay's loop, a stall that grew with the rate.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import operator
import pickle
from typing import Any, Callable

from ..capture import from_records
from ..diagnosis import Incident, Options, Rule
from ..diagnosis.live import LiveDiagnoser
from ..model import KINDS, CaptureMeta
from ..workers import stop_pool, worker_pool

log = logging.getLogger("kvdoctor.attach")

#: the window percentiles exported to /metrics: (signal prefix, metric name)
PERCENTILES = (("ttft", "kvdoctor_ttft_seconds"), ("tpot", "kvdoctor_tpot_seconds"),
               ("itl", "kvdoctor_itl_seconds"), ("e2e", "kvdoctor_e2e_seconds"))
OTEL_SIGNALS = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


@dataclasses.dataclass(frozen=True)
class StepResult:
    opened: list[Incident]
    closed: list[Incident]
    #: every incident the diagnoser keeps (open ones first-class, the last closed ones)
    incidents: list[Incident]
    #: metric name -> {quantile label: seconds} for the window that ended at the step
    percentiles: dict[str, dict[str, float]]
    kv_full_forecast_s: float
    otel: dict[str, float]


def record_time_s(record: Any) -> float:
    t = getattr(record, "time_s", None)
    if t is None:
        t = record.finish_s or record.arrival_s or 0.0
    return t


class RecentPast:
    """Records of the last ``keep_s`` seconds by kind, appended in time order; ``time_of`` reads an
    item's time (a record's, or a packed record's)."""

    def __init__(self, keep_s: float, time_of: Callable[[Any], float] = record_time_s):
        self.keep_s = keep_s
        self.time_of = time_of
        self.records: dict[str, collections.deque] = {k: collections.deque() for k in KINDS}

    def add(self, new: dict[str, list]) -> None:
        for kind, recs in new.items():
            self.records[kind].extend(recs)

    def trim(self, now_s: float) -> None:
        for dq in self.records.values():
            while dq and self.time_of(dq[0]) < now_s - self.keep_s:
                dq.popleft()


class _State:  # the worker process's one diagnoser
    live: LiveDiagnoser
    past: RecentPast


def _init(rules: list[Rule], options: Options, keep_s: float) -> None:
    _State.live, _State.past = LiveDiagnoser(rules, options), RecentPast(keep_s)


def pack(record: Any) -> tuple[float, bytes]:
    """A record as the agent keeps it: its time, and itself pickled."""
    return record_time_s(record), pickle.dumps(record, pickle.HIGHEST_PROTOCOL)


def unpack(packed: list[tuple[float, bytes]]) -> list:
    return [pickle.loads(b) for _, b in packed]


def _step(meta: CaptureMeta, new: dict[str, list], in_flight: list, now_s: float) -> StepResult:
    past = _State.past
    past.add({k: unpack(v) for k, v in new.items()})
    past.trim(now_s)
    recent = {k: list(v) for k, v in past.records.items()}
    recent["requests"] += in_flight  # requests still waiting or streaming count too (live only)
    opened, closed = _State.live.step(from_records(meta, **recent), now_s)
    w = _State.live.last_window
    pct: dict[str, dict[str, float]] = {}
    for prefix, metric in PERCENTILES:
        for q in (50, 90, 99):
            name = f"{prefix}_p{q}_s"
            if name != "itl_p90_s":
                v = w.value(name)
                if v == v:
                    pct.setdefault(metric, {})[f"0.{q}"] = v
    return StepResult(opened, closed, list(_State.live.incidents), pct,
                      w.value("kv_full_forecast_min") * 60, {m: w.value(m) for m in OTEL_SIGNALS})


class LiveWorker:
    """The agent's side: send what is new, get a StepResult. A worker that died is started
    again with the whole recent past (its hold state starts over: an incident re-opens only
    after its rule's ``for:``)."""

    def __init__(self, rules: list[Rule], options: Options, keep_s: float):
        self._args = (rules, options, keep_s)
        #: the agent's copy, to start a new worker from: (time, pickled record) items (see above)
        self.past = RecentPast(keep_s, time_of=operator.itemgetter(0))
        self._new: dict[str, list] = {k: [] for k in KINDS}
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def add(self, kind: str, record: Any) -> None:
        """A record just captured (on the event loop)."""
        item = pack(record)
        self.past.records[kind].append(item)
        self._new[kind].append(item)

    def recent(self, kind: str) -> list:
        """The agent's copy of the recent past of ``kind``, as records."""
        return unpack(list(self.past.records[kind]))

    def take_new(self, now_s: float) -> dict[str, list]:
        """What the worker has not seen yet, all of the recent past for a new worker (on the loop);
        packed records (:func:`pack`)."""
        self.past.trim(now_s)
        if self._pool is None:
            new = {k: list(v) for k, v in self.past.records.items()}
        else:
            new = self._new
        self._new = {k: [] for k in KINDS}
        return new

    def step(self, meta: CaptureMeta, new: dict[str, list], in_flight: list, now_s: float,
             timeout_s: float | None = None) -> StepResult:
        """One step in the worker process (blocks: call it from a thread). ``meta``: the capture's
        as of now (the agent learns the engine and its config while it runs)."""
        if self._pool is None:
            self._pool = worker_pool(_init, *self._args)
        try:
            return self._pool.submit(_step, meta, new, in_flight, now_s).result(timeout=timeout_s)
        except concurrent.futures.process.BrokenProcessPool:
            log.warning("the live diagnosis process died; starting another on the recent past")
            self._pool = None
            raise

    def close(self) -> None:
        if self._pool is not None:
            stop_pool(self._pool)
            self._pool = None
