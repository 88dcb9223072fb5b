"""The sidecar loop: sources -> capture on disk + recent-past buffer -> live diagnosis ->
terminal, webhook, /metrics, OpenTelemetry.

Polled sources run in worker threads on their own interval; push sources (proxy, OTLP
receiver) emit from the event loop. A source that cannot read is recorded once (capture meta
and log) and retried; nothing a source or the server does makes the agent exit.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import __version__
from ..capture import CaptureWriter
from ..capture.queued import QueuedWriter
from ..capture.writer import kind_of
from ..capture.memory import from_records
from ..diagnosis import Incident, Options, Rule
from ..errors import InputError
from ..diagnosis.live import LiveDiagnoser
from ..model import CaptureMeta, EngineSample, Event, GpuSample, RequestRecord
from .serve import Metrics, make_app
from ..collect.base import PolledCollector, SourceUnavailable

log = logging.getLogger("kvdoctor.attach")

#: at shutdown, open proxy streams and a running evaluation get this long before they are cut
SHUTDOWN_GRACE_S = 2.0
EXIT_INTERRUPTED = 130
#: `attach` exits with this when the run ended normally but records could not be written
EXIT_CAPTURE_INCOMPLETE = 5


def host_port(text: str, default_port: int, option: str = "address") -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT``, ``HOST`` or a bare ``PORT`` (loopback) as (host, port);
    InputError naming ``option`` otherwise."""
    text = text.strip()
    if text.isdigit():
        host, port = "127.0.0.1", text
    elif text.startswith("[") and "]" in text:  # [::1]:9000 or [::1]
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else (str(default_port) if not rest else "x")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
        host = host or "127.0.0.1"
    elif ":" not in text:
        host, port = text or "127.0.0.1", str(default_port)
    else:  # a bare IPv6 address
        host, port = text, str(default_port)
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InputError(f"{option} {text!r}: expected HOST:PORT, PORT or HOST with a port from 0 to 65535, "
                         "e.g. 127.0.0.1:9000")
    return host, int(port)


@dataclass
class AttachConfig:
    server_url: str
    capture_dir: Path
    listen: str | None = "127.0.0.1:9400"
    proxy: str | None = None
    otlp_receiver: str | None = None
    otlp_grpc_receiver: str | None = None
    rules: list[Rule] = field(default_factory=list)
    options: Options = field(default_factory=lambda: Options(lookback_s=300.0, step_s=5.0))
    webhook: str | None = None
    token: str | None = None
    otlp_endpoint: str | None = None
    store_text: bool = False
    engine_config: dict[str, Any] = field(default_factory=dict)
    max_capture_bytes: int | None = 1 << 30
    duration_s: float | None = None
    collectors: list[PolledCollector] = field(default_factory=list)
    on_change: Callable[[str, Incident], None] | None = None


class Agent:
    def __init__(self, cfg: AttachConfig):
        self.cfg = cfg
        meta = CaptureMeta(created_unix_s=time.time(), server=cfg.server_url, origin="attach",
                           config=dict(cfg.engine_config), text_stored=cfg.store_text, tool_version=__version__)
        # drop_on_error: a full or read-only disk costs records (counted), never the sidecar
        self.writer = QueuedWriter(
            CaptureWriter(cfg.capture_dir, meta, max_bytes=cfg.max_capture_bytes, drop_on_error=True),
            on_drop=lambda kind, n: self.metrics["kvdoctor_capture_dropped_total"].labels(kind=kind).inc(n))
        self.metrics = Metrics()
        # a gauge starts at 0, which for this one reads "KV full now": unknown until the first step
        self.metrics["kvdoctor_kv_full_forecast_seconds"].set(float("nan"))
        self._set_info(None)
        self.live = LiveDiagnoser(cfg.rules, cfg.options)
        self._recent: dict[str, collections.deque] = {k: collections.deque() for k in ("requests", "gpu", "host", "engine", "events")}
        self._status: dict[str, tuple[bool, str]] = {}
        self.errors: dict[str, dict[str, Any]] = {}  # source -> {count, last}: unexpected errors
        self._errors_logged: set[tuple[str, str]] = set()
        self._stop = asyncio.Event()
        self._runners: list[Any] = []
        self._grpc: Any = None  # the OTLP/gRPC receiver's grpc.aio server
        self.started_s = time.time()
        self.steps = 0
        self.otel = None
        self._proxy = None  # the streaming proxy, when there is one: its in-flight requests
        # two workers suffice for the blocking reads (NVML, psutil, HTTP scrape), and fewer
        # threads mean fewer malloc arenas: part of keeping the sidecar under ~100 MiB
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvdoctor-source")
        self._live_lock = threading.Lock()
        self._report_lock = threading.Lock()
        self._report_cache: tuple[int, str] | None = None
        self.reports_rendered = 0
        self._render_pool: concurrent.futures.ProcessPoolExecutor | None = None

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
        self._recent[kind].append(record)
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
            if record.kind == "config":
                detail = {k: v for k, v in record.detail.items() if k != "engine"}
                self.writer.update_meta(config={**self.writer.meta.config, **detail, **self.cfg.engine_config},
                                        engine=record.detail.get("engine") or self.writer.meta.engine)
                self._set_info(self.writer.meta.engine)

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

    # -- loops --------------------------------------------------------------------------
    async def _poll(self, c: PolledCollector) -> None:
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

    # -- lifecycle ----------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        w = self.writer
        dropped = {k: n + w.queue_dropped[k] for k, n in w.dropped.items() if n + w.queue_dropped[k]}
        return {"status": "degraded" if w.last_error else "ok",
                "uptime_s": round(time.time() - self.started_s, 1), "capture": str(self.cfg.capture_dir),
                "records": dict(w.counts), "capture_dropped": dropped, "capture_error": w.last_error,
                "sources": {k: {"ok": v[0], "detail": v[1]} for k, v in self._status.items()},
                "errors": {k: dict(v) for k, v in self.errors.items()},
                "open_incidents": len(self.live.open_incidents)}

    def report_html(self) -> str | None:
        try:
            import plotly  # noqa: F401  (the report's one optional dependency)
        except ImportError:
            return None

        with self._report_lock:  # one render at a time; a page per capture size, reused until records arrive
            self.writer.flush()  # every queued record on disk first
            key = sum(self.writer.counts.values())
            if self._report_cache is not None and self._report_cache[0] == key:
                return self._report_cache[1]
            # in a process of its own: rendering is seconds of Python, and in a thread it would
            # hold the GIL the proxy relays with (measured: hundreds of ms added to TTFT P99)
            if self._render_pool is None:
                import multiprocessing

                self._render_pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            html = self._render_pool.submit(_render_report, str(self.cfg.capture_dir), self.cfg.rules,
                                            self.cfg.options).result(timeout=REPORT_TIMEOUT_S)
            self._report_cache = (key, html)
            self.reports_rendered += 1
            return html

    async def _start_http(self) -> None:
        from aiohttp import web

        if self.cfg.listen:
            host, port = host_port(self.cfg.listen, 9400, "--listen")
            app = make_app(self.metrics, lambda: [i.to_json() for i in self.live.incidents], self.health,
                           self.report_html, self.cfg.token)
            await self._site(web, app, host, port, "endpoints")
        if self.cfg.proxy:
            from ..collect.proxy import make_proxy_app

            host, port = host_port(self.cfg.proxy, 9000, "--proxy")
            from ..collect.proxy import PROXY_KEY

            app = make_proxy_app(self.cfg.server_url, self, store_text=self.cfg.store_text)
            self._proxy = app[PROXY_KEY]
            await self._site(web, app, host, port, "proxy")
        if self.cfg.otlp_receiver:
            from ..collect.otlp_receiver import make_app as make_receiver

            host, port = host_port(self.cfg.otlp_receiver, 4318, "--otlp-receiver")
            await self._site(web, make_receiver(self), host, port, "otlp")
        if self.cfg.otlp_grpc_receiver:
            from ..collect.otlp_grpc import DEFAULT_PORT, start_grpc_receiver

            host, port = host_port(self.cfg.otlp_grpc_receiver, DEFAULT_PORT)
            self._grpc, _, bound = await start_grpc_receiver(self, host, port)
            log.info("otlp-grpc listening on %s:%d", host, bound)

    async def _site(self, web, app, host: str, port: int, what: str) -> None:
        # auto_decompress off: the proxy passes bodies byte for byte, the OTLP receiver inflates itself
        # shutdown_timeout: a stream still open at SIGTERM is cut after this, not waited on for a minute
        runner = web.AppRunner(app, access_log=None, auto_decompress=False, shutdown_timeout=SHUTDOWN_GRACE_S)
        await runner.setup()
        self._runners.append(runner)
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:
            raise InputError(f"{what}: cannot listen on {host}:{port} ({e.strerror or e}); choose another HOST:PORT") from None
        log.info("%s listening on http://%s:%d", what, host, port)

    def stop(self) -> None:
        self._stop.set()

    def _on_signal(self) -> None:
        if self._stop.is_set():  # a second Ctrl-C / SIGTERM: the operator means now
            log.warning("second signal: exiting without waiting")
            os._exit(EXIT_INTERRUPTED)
        log.info("stopping: closing the capture")
        self.stop()

    def capture_problem(self) -> str | None:
        """After ``run``: why the capture is incomplete (records dropped, meta not written), or None."""
        w = self.writer
        lost = sum(w.dropped.values()) + sum(w.queue_dropped.values())
        if lost:
            return f"{lost} record(s) could not be written ({w.last_error or 'disk full or read-only'})"
        if w.last_error:
            return f"the capture could not be fully written ({w.last_error})"
        return None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests) or Windows
                pass
        if self.cfg.otlp_endpoint:
            from .otel_export import OtelExport

            self.otel = OtelExport(self.cfg.otlp_endpoint)
        try:
            await self._start_http()
            tasks = [asyncio.create_task(self._poll(c)) for c in self.cfg.collectors]
            tasks.append(asyncio.create_task(self._diagnose_loop()))
            if self.cfg.duration_s:
                loop.call_later(self.cfg.duration_s, self.stop)
            await self._stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for runner in self._runners:
                await runner.cleanup()
            if self._grpc is not None:
                await self._grpc.stop(1.0)
            try:
                self.diagnose_now()
            except Exception:
                log.exception("final diagnosis failed")
            if self.otel:
                self.otel.shutdown()
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self._render_pool is not None:
                self._render_pool.shutdown(wait=False, cancel_futures=True)
            self.writer.close()


REPORT_TIMEOUT_S = 120.0


def _render_report(capture_dir: str, rules: list[Rule], options: Options) -> str:
    """/report's page, in the render process."""
    from ..capture import load
    from ..diagnosis import diagnose
    from ..report.html import render_html

    return render_html(diagnose(load(capture_dir), rules, options))


def _time(record: Any) -> float:
    t = getattr(record, "time_s", None)
    if t is None:
        t = record.finish_s or record.arrival_s or 0.0
    return t


def exit_promptly(code: int, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Exit with ``code`` once the capture is closed. Worker threads still blocked in a read
    (a source that never answers) get ``grace_s``; after that the process exits regardless,
    since the interpreter would otherwise wait on them forever at exit."""
    deadline = time.monotonic() + grace_s
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join(max(deadline - time.monotonic(), 0.0))
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        log.warning("a source is still blocked after %.0f s; exiting without it", grace_s)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)
