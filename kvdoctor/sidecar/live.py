"""The agent's live diagnosis: a step every ``options.step_s`` over the recent past (in a
process of its own, see live_worker), incidents announced as they open and close (log, capture event, webhook,
OpenTelemetry) and the window's percentiles exported to /metrics."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any

from ..capture import QueuedWriter
from ..diagnosis import Incident
from ..model import Event
from .live_worker import LiveWorker, StepResult
from .serve import Metrics

log = logging.getLogger("kvdoctor.attach")


class LiveDiagnosis:
    """The agent's live diagnosis. ``writer``, ``metrics``, ``live_worker``, ``stop`` and ``pool``
    are the agent's, shared; it sets ``proxy`` (the relay: requests in flight) and ``otel`` (the
    OpenTelemetry export) when it starts them."""

    def __init__(self, cfg: Any, writer: QueuedWriter, metrics: Metrics, live_worker: LiveWorker,
                 stop: asyncio.Event, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self.cfg = cfg  # AttachConfig
        self.writer = writer
        self.metrics = metrics
        self.live_worker = live_worker
        self._stop = stop
        self._pool = pool
        # a gauge starts at 0, which for this one reads "KV full now": unknown until the first step
        self.metrics["kvdoctor_kv_full_forecast_seconds"].set(float("nan"))
        #: the live diagnoser's incidents as of its last step (open ones and the last closed ones)
        self.incidents: list[Incident] = []
        self.steps = 0
        self.otel: Any = None
        self.proxy: Any = None
        self._live_lock = threading.Lock()

    def open_incidents(self) -> int:
        return sum(1 for i in self.incidents if i.open)

    async def run(self) -> None:
        """A step every ``options.step_s`` until the agent stops."""
        step = self.cfg.options.step_s
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), step)
            except asyncio.TimeoutError:
                pass
            try:
                # the evaluation runs in a process of its own (live_worker), waited on from a
                # thread: on the event loop, or in a thread holding the GIL, it would hold up
                # the proxy's streams for its whole duration (their stamps included)
                now_s = time.time()
                new, in_flight = self._new_records(now_s)
                opened, closed = await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._evaluate, new, in_flight, now_s)
                self._announce_changes(opened, closed)
            except Exception:
                log.exception("live diagnosis failed (capture continues)")

    def _new_records(self, now_s: float) -> tuple[dict[str, list], list]:
        """What the worker has not seen, and the requests still waiting or streaming (on the
        loop thread, which appends records)."""
        in_flight = self.proxy.in_flight_records() if self.proxy is not None else []
        return self.live_worker.take_new(now_s), in_flight

    def _evaluate(self, new: dict[str, list], in_flight: list, now_s: float) -> tuple[list[Incident], list[Incident]]:
        with self._live_lock:  # one step at a time (the final step at shutdown may meet a running one)
            res = self.live_worker.step(self.writer.meta, new, in_flight, now_s)
            self.steps += 1
            self.incidents = res.incidents
            self._export(res)
        return res.opened, res.closed

    def diagnose_now(self, now_s: float | None = None) -> tuple[list[Incident], list[Incident]]:
        """One live step, synchronously (tests, and the last step at shutdown)."""
        now_s = now_s or time.time()
        opened, closed = self._evaluate(*self._new_records(now_s), now_s)
        self._announce_changes(opened, closed)
        return opened, closed

    def _announce_changes(self, opened: list[Incident], closed: list[Incident]) -> None:
        for inc in opened:
            self.metrics["kvdoctor_incidents_opened_total"].labels(rule=inc.top.rule.id).inc()
            self._announce("opened", inc)
        for inc in closed:
            self._announce("closed", inc)
        active = self.metrics["kvdoctor_incident_active"]
        active.clear()
        for inc in (i for i in self.incidents if i.open):
            active.labels(rule=inc.top.rule.id, symptom=inc.symptom, severity=inc.severity).set(1)

    def _export(self, res: StepResult) -> None:
        for metric, by_q in res.percentiles.items():
            for q, v in by_q.items():
                self.metrics[metric].labels(quantile=q).set(v)
        # NaN (not growing, or no KV gauge) replaces the last forecast: a stale "full in 2 min"
        # would outlive the pressure that made it
        self.metrics["kvdoctor_kv_full_forecast_seconds"].set(res.kv_full_forecast_s)
        if self.otel:
            self.otel.percentiles(res.otel)

    def _announce(self, what: str, inc: Incident) -> None:
        from ..report.summary import live_incident_text
        from ..units import printable

        text = live_incident_text(inc, what, self.writer.meta.engine)
        log.warning("%s", printable(text))
        if self.cfg.on_change:
            self.cfg.on_change(what, inc)
        self.writer.write(Event(time_s=time.time(), kind=f"incident-{what}",
                                detail={"id": inc.id, "rule": inc.top.rule.id, "symptom": inc.symptom}))
        if self.cfg.webhook:
            asyncio.get_running_loop().create_task(self._post_webhook(text, what, inc))
        if self.otel:
            self.otel.incident(what, inc)

    async def _post_webhook(self, text: str, what: str, inc: Incident) -> None:
        import aiohttp

        body = {"text": text, "event": what, "incident": inc.to_json()}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                async with s.post(self.cfg.webhook, json=body) as resp:
                    if resp.status >= 300:
                        log.warning("webhook answered HTTP %s", resp.status)
        except Exception as e:
            log.warning("webhook failed: %s", e)

