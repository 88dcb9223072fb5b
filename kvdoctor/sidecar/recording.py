"""The agent's recording side: the Sink every source writes to (capture on disk, recent-past
buffer, /metrics), the polling loop of each polled source, and what /healthz and the exit code
say about sources and the capture. Polled sources run in worker threads on their own interval;
a source that cannot read is recorded once (capture meta and log) and retried."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Callable

from .. import __version__
from ..capture.queued import QueuedWriter
from ..capture.writer import kind_of
from ..collect.base import PolledCollector, SourceUnavailable
from ..model import CaptureMeta, EngineSample, Event, GpuSample, RequestRecord
from .serve import Metrics

log = logging.getLogger("kvdoctor.attach")


class Recording:
    """The agent's Sink (:class:`~kvdoctor.sidecar.agent.Agent` hands it to every source) and what
    it knows of the sources and the capture. ``writer``, ``metrics``, ``live_worker``, ``stop`` and
    ``pool`` are the agent's, shared; ``open_incidents`` counts the live diagnosis' open incidents."""

    def __init__(self, cfg: Any, writer: QueuedWriter, metrics: Metrics, live_worker: Any, stop: asyncio.Event,
                 pool: concurrent.futures.ThreadPoolExecutor, open_incidents: Callable[[], int],
                 identify: Any = None) -> None:
        self.cfg = cfg  # AttachConfig
        self.writer = writer
        self.metrics = metrics
        self.live_worker = live_worker  # LiveWorker: gets every record for the live window
        self._stop = stop
        self._pool = pool
        self._open_incidents = open_incidents
        #: the IdentifyCollector (kvdoctor.collect.identify) or None: asked again when the server returns
        self.identify = identify
        self.started_s = time.time()
        self.errors: dict[str, dict[str, Any]] = {}  # source -> {count, last}: unexpected errors
        self._errors_logged: set[tuple[str, str]] = set()
        self._status: dict[str, tuple[bool, str]] = {}
        #: the garbage collections run between proxied requests (cfg.gc_between_requests), for /healthz
        self.idle_gc: Any = None
        #: meta.json's writes, on a thread of their own (_meta_later)
        self._meta_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._set_info(None)

    # -- the Sink protocol: every record from every source comes through here ----------------
    def emit(self, record: Any) -> None:
        """Never raises: whatever goes wrong in recording one record is counted and logged once."""
        try:
            self._emit(record)
        except Exception as e:  # noqa: BLE001 - a push source (the proxy) must never see our errors
            self.collector_error("capture", e)

    def _emit(self, record: Any) -> None:
        kind = kind_of(record)
        self.writer.write(record)  # queued: the disk is the writer thread's business
        self.live_worker.add(kind, record)
        self.metrics["kvdoctor_capture_records_total"].labels(kind=kind).inc()
        if isinstance(record, RequestRecord):
            self.metrics["kvdoctor_requests_total"].labels(status=record.status or "ok").inc()
        elif isinstance(record, GpuSample):
            gpu = str(record.gpu_index)
            for name, value in (("kvdoctor_gpu_memory_used_bytes", record.mem_used_bytes),
                                ("kvdoctor_gpu_memory_total_bytes", record.mem_total_bytes),
                                ("kvdoctor_gpu_memory_bandwidth_ratio",
                                 record.dram_bw_util_frac if record.dram_bw_util_frac is not None else record.mem_util_frac)):
                if value is not None:
                    self.metrics[name].labels(gpu=gpu).set(value)
        elif isinstance(record, EngineSample) and "kv_usage_frac" in record.values:
            self.metrics["kvdoctor_kv_usage_ratio"].set(record.values["kv_usage_frac"])
        elif isinstance(record, Event):
            if record.kind in ("server-down", "server-up", "server-restart"):
                self.metrics["kvdoctor_server_up"].set(0 if record.kind == "server-down" else 1)
                log.warning("server event: %s %s", record.kind, record.detail.get("reason", ""))
                if record.kind != "server-down" and self.identify is not None:
                    self.identify.again()  # back or restarted: maybe another version or model
            if record.kind == "identity":
                d = record.detail
                self._meta_later(lambda m: dict(engine=d.get("engine") or m.engine,
                                                engine_version=d.get("engine_version"), model=d.get("model")))
                log.info("server identified: %s %s serving %s", d.get("engine"), d.get("engine_version") or "",
                         d.get("model") or "an unnamed model")
            if record.kind == "config":
                detail = {k: v for k, v in record.detail.items() if k != "engine"}
                engine = record.detail.get("engine")
                self._meta_later(lambda m: dict(config={**m.config, **detail, **self.cfg.engine_config},
                                                engine=engine or m.engine))

    def _meta_later(self, change: Callable[[CaptureMeta], dict[str, Any]]) -> None:
        """Apply ``change(meta)`` to the capture's meta on a thread of its own, in arrival order:
        writing meta.json (with its fsync, ms to tens of ms on a busy disk) stays off the event
        loop the proxy relays on. :meth:`flush_meta` waits for what is pending."""
        if self._meta_pool is None:
            self._meta_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvdoctor-meta")
        self._meta_pool.submit(self._apply_meta, change)

    def _apply_meta(self, change: Callable[[CaptureMeta], dict[str, Any]]) -> None:
        try:
            meta = self.writer.update_meta(**change(self.writer.meta))
            self._set_info(meta.engine)
        except Exception as e:  # noqa: BLE001 - counted and logged like any recording error
            self.collector_error("capture", e)

    def flush_meta(self) -> None:
        """Wait for the meta changes handed to :meth:`_meta_later` (at shutdown, before the capture closes)."""
        pool, self._meta_pool = self._meta_pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def collector_error(self, source: str, exc: BaseException) -> None:
        """An unexpected error in a source or in recording its records: counted (healthz, the
        kvdoctor_collector_errors_total metric), logged once per distinct error, never raised."""
        text = f"{type(exc).__name__}: {str(exc)[:300]}"
        entry = self.errors.setdefault(source, {"count": 0, "last": ""})
        entry["count"] += 1
        entry["last"] = text
        try:
            self.metrics["kvdoctor_collector_errors_total"].labels(source=source).inc()
        except Exception:  # noqa: BLE001
            pass
        key = (source, text)
        if key not in self._errors_logged and len(self._errors_logged) < 1000:
            self._errors_logged.add(key)
            log.error("%s: %s (counted in /healthz; going on)", source, text, exc_info=exc)

    def _set_info(self, engine: str | None) -> None:
        info = self.metrics["kvdoctor_info"]
        info.clear()
        info.labels(server=self.cfg.server_url, engine=engine or "", version=__version__).set(1)

    def source_status(self, name: str, ok: bool, detail: str = "") -> None:
        if self._status.get(name) == (ok, detail):
            return
        was = self._status.get(name)
        self._status[name] = (ok, detail)
        self.metrics["kvdoctor_source_up"].labels(source=name).set(1 if ok else 0)
        try:
            self.writer.source_status(name, ok, detail)
        except Exception as e:  # noqa: BLE001 - the status is in memory and /healthz either way
            self.collector_error("capture", e)
        if not ok:
            log.warning("%s: %s", name, detail)
        elif was is not None and not was[0]:
            log.info("%s: reading again", name)

    # -- the polled sources' loop -------------------------------------------------------
    async def poll(self, c: PolledCollector) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            now = time.time()
            try:
                try:
                    records = await loop.run_in_executor(self._pool, c.collect, now)
                    status = (True, "")
                except SourceUnavailable as e:
                    records, status = e.records, (False, str(e))
                except Exception as e:  # noqa: BLE001 - a bug in one source must not stop it or the others
                    self.collector_error(c.name, e)
                    records, status = [], (False, f"{type(e).__name__}: {str(e)[:300]}")
                self.source_status(c.name, *status)
                for r in records:
                    self.emit(r)
            except Exception as e:  # noqa: BLE001 - the loop goes on, whatever happened in it
                if self._stop.is_set():  # shutting down: the pool may be gone already
                    return
                self.collector_error(c.name, e)
            try:
                await asyncio.wait_for(self._stop.wait(), max(c.interval_s - (time.time() - now), 0.0))
            except asyncio.TimeoutError:
                pass

    # -- what /healthz and the exit code report -----------------------------------------
    def health(self) -> dict[str, Any]:
        w = self.writer
        dropped = {k: n + w.queue_dropped[k] for k, n in w.dropped.items() if n + w.queue_dropped[k]}
        return {"status": "degraded" if w.last_error else "ok",
                "uptime_s": round(time.time() - self.started_s, 1), "capture": str(self.cfg.capture_dir),
                "records": dict(w.counts), "capture_dropped": dropped, "capture_error": w.last_error,
                "sources": {k: {"ok": v[0], "detail": v[1]} for k, v in self._status.items()},
                "errors": {k: dict(v) for k, v in self.errors.items()},
                "open_incidents": self._open_incidents(),
                "gc": self._gc_health()}

    def _gc_health(self) -> dict[str, Any]:
        """Where this process's garbage collections run: CPython's own trigger (``automatic``), or
        between proxied requests (kvdoctor.idle_gc) with how many ran per generation and how many
        could not wait for a gap (``forced_while_busy``: traffic with always a request in flight)."""
        g = self.idle_gc
        if g is None:
            return {"mode": "automatic"}
        return {"mode": "between_requests", "collections": {"young": g.collections[0], "middle": g.collections[1],
                                                            "full": g.collections[2]},
                "forced_while_busy": g.forced}

    def capture_problem(self) -> str | None:
        """After ``run``: why the capture is incomplete (records dropped, meta not written), or None."""
        w = self.writer
        lost = sum(w.dropped.values()) + sum(w.queue_dropped.values())
        if lost:
            return f"{lost} record(s) could not be written ({w.last_error or 'disk full or read-only'})"
        if w.last_error:
            return f"the capture could not be fully written ({w.last_error})"
        return None
