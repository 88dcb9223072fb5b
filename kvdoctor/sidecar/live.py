"""The agent's live diagnosis: a step every ``options.step_s`` over the recent-past buffer (in
a worker thread), incidents announced as they open and close (log, capture event, webhook,
OpenTelemetry) and the window's percentiles exported to /metrics."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from typing import Any

from ..capture.memory import from_records
from ..capture.queued import QueuedWriter
from ..diagnosis import Incident
from ..diagnosis.live import LiveDiagnoser
from ..model import Event
from .serve import Metrics

log = logging.getLogger("kvdoctor.attach")


class LiveDiagnosis:
    """Mixed into :class:`~kvdoctor.sidecar.agent.Agent`, which sets these up."""

    cfg: Any  # AttachConfig
    writer: QueuedWriter
    metrics: Metrics
    live: LiveDiagnoser
    steps: int
    otel: Any
    _recent: dict[str, collections.deque]
    _stop: asyncio.Event
    _pool: concurrent.futures.ThreadPoolExecutor
    _live_lock: threading.Lock
    _proxy: Any

    async def _diagnose_loop(self) -> None:
        step = self.cfg.options.step_s
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), step)
            except asyncio.TimeoutError:
                pass
            try:
                # the evaluation runs in a worker thread: on the event loop it would hold up the
                # proxy's requests for its whole duration (their arrival stamps included)
                now_s = time.time()
                recent = self._snapshot(now_s)
                opened, closed = await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._evaluate, recent, now_s)
                self._announce_changes(opened, closed)
            except Exception:
                log.exception("live diagnosis failed (capture continues)")

    def _snapshot(self, now_s: float) -> dict[str, list]:
        """The recent records as lists (on the loop thread, which appends to the deques)."""
        keep_s = self.cfg.options.lookback_s + max((r.for_s for r in self.cfg.rules), default=0) + 60
        for dq in self._recent.values():
            while dq and _time(dq[0]) < now_s - keep_s:
                dq.popleft()
        recent = {k: list(v) for k, v in self._recent.items()}
        if self._proxy is not None:  # requests still waiting or streaming count too (live only)
            recent["requests"] += self._proxy.in_flight_records()
        return recent

    def _evaluate(self, recent: dict[str, list], now_s: float) -> tuple[list[Incident], list[Incident]]:
        cap = from_records(self.writer.meta, **recent)
        with self._live_lock:  # one step at a time (the final step at shutdown may meet a running one)
            opened, closed = self.live.step(cap, now_s)
            self.steps += 1
            self._export_percentiles(self.live.last_window)
        return opened, closed

    def diagnose_now(self, now_s: float | None = None) -> tuple[list[Incident], list[Incident]]:
        """One live step, synchronously (tests; the running sidecar uses _diagnose_loop)."""
        now_s = now_s or time.time()
        opened, closed = self._evaluate(self._snapshot(now_s), now_s)
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
        for inc in self.live.open_incidents:
            active.labels(rule=inc.top.rule.id, symptom=inc.symptom, severity=inc.severity).set(1)

    def _export_percentiles(self, w) -> None:
        for prefix, metric in (("ttft", "kvdoctor_ttft_seconds"), ("tpot", "kvdoctor_tpot_seconds"),
                               ("itl", "kvdoctor_itl_seconds"), ("e2e", "kvdoctor_e2e_seconds")):
            for q in (50, 90, 99):
                name = f"{prefix}_p{q}_s"
                if name not in ("itl_p90_s",):
                    v = w.value(name)
                    if v == v:
                        self.metrics[metric].labels(quantile=f"0.{q}").set(v)
        # NaN (not growing, or no KV gauge) replaces the last forecast: a stale "full in 2 min"
        # would outlive the pressure that made it
        self.metrics["kvdoctor_kv_full_forecast_seconds"].set(w.value("kv_full_forecast_min") * 60)
        if self.otel:
            self.otel.percentiles({m: w.value(m) for m in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")})

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


def _time(record: Any) -> float:
    t = getattr(record, "time_s", None)
    if t is None:
        t = record.finish_s or record.arrival_s or 0.0
    return t
