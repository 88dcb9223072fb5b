"""The sidecar loop: sources -> capture on disk + recent-past buffer -> live diagnosis ->
terminal, webhook, /metrics, OpenTelemetry.

This module holds the configuration, the listeners and the run/shutdown sequence; the agent's
other responsibilities are its parts, each with its own state: ``recording`` (the Sink, polled
sources, /healthz), ``live`` (the diagnosis loop and incident announcements) and ``report``
(/report). They share the capture writer, the metrics, the live worker and the thread pool.
Push sources (proxy, OTLP receiver) emit from the event loop. Nothing a source or the server
does makes the agent exit.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
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
from ..capture import CaptureWriter, QueuedWriter
from ..collect.base import PolledCollector
from ..diagnosis import Incident, Options, Rule
from ..errors import InputError
from ..model import CaptureMeta
from .live import LiveDiagnosis
from .live_worker import LiveWorker
from .recording import Recording
from .report_page import ReportPage
from .serve import Metrics, make_app


log = logging.getLogger("kvdoctor.attach")

#: at shutdown, open proxy streams and a running evaluation get this long before they are cut
SHUTDOWN_GRACE_S = 2.0
EXIT_INTERRUPTED = 130
#: `attach` exits with this when the run ended normally but records could not be written
EXIT_CAPTURE_INCOMPLETE = 5


#: options that need an extra installed: (AttachConfig field, extra, module it brings)
OPTIONAL = (("otlp_grpc_receiver", "grpc", "grpc"),)


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
    #: garbage collection from a loop timer while no proxied request is in flight, not in the
    #: middle of one (kvdoctor.idle_gc; process-wide, so the CLI turns it on, not a library user)
    gc_between_requests: bool = False
    #: ask the server which engine, version and model it is (kvdoctor.collect.identify)
    identify: bool = True
    #: processes relaying on the proxy's address: this one and ``proxy_workers - 1`` more
    #: (relay_workers.py; one event loop carries ~16-60k SSE events/s on a core)
    proxy_workers: int = 1

    def __post_init__(self) -> None:
        # an option whose extra is not installed: one line naming it, before anything starts
        for option, extra, module in OPTIONAL:
            if getattr(self, option):
                try:
                    importlib.import_module(module)
                except ImportError:
                    raise InputError(f"--{option.replace('_', '-')} needs the {extra} extra ({module} is not "
                                     f"installed): pip install 'kvdoctor[{extra}]'") from None


class Agent:
    """The sidecar: ``await Agent(cfg).run()`` until stopped (signal, ``duration_s`` or :meth:`stop`)."""

    def __init__(self, cfg: AttachConfig):
        self.cfg = cfg
        # what the user declared is also kept apart, so the effective configuration can say so
        config = {**cfg.engine_config, "declared": dict(cfg.engine_config)} if cfg.engine_config else {}
        meta = CaptureMeta(created_unix_s=time.time(), server=cfg.server_url, origin="attach",
                           config=config, text_stored=cfg.store_text, tool_version=__version__)
        self.metrics = Metrics()
        # drop_on_error: a full or read-only disk costs records (counted), never the sidecar
        self.writer = QueuedWriter(
            CaptureWriter(cfg.capture_dir, meta, max_bytes=cfg.max_capture_bytes, drop_on_error=True),
            on_drop=lambda kind, n: self.metrics["kvdoctor_capture_dropped_total"].labels(kind=kind).inc(n))
        # the recent past the live step looks at: its lookback, the longest hold, a minute's margin
        keep_s = cfg.options.lookback_s + max((r.for_s for r in cfg.rules), default=0) + 60
        self.live_worker = LiveWorker(cfg.rules, cfg.options, keep_s)
        self._stop = asyncio.Event()
        # two workers suffice for the blocking reads (NVML, psutil, HTTP scrape), and fewer
        # threads mean fewer malloc arenas: part of keeping the sidecar under ~100 MiB
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvdoctor-source")
        identify: Any = None
        if cfg.identify:
            from ..collect.identify import IdentifyCollector

            scrapes = [c for c in cfg.collectors if getattr(c, "name", "") == "scrape"]
            host = next((c for c in cfg.collectors if hasattr(c, "server_cmdline")), None)
            # the engine the /metrics names say, as evidence when the model listing names none;
            # the server process's flags (same host), for the settings the engine does not report
            identify = IdentifyCollector(cfg.server_url, hint=lambda: next(
                (c.engine for c in scrapes if getattr(c, "engine", None) not in (None, "dcgm")), None),
                cmdline=host.server_cmdline if host is not None else None)
        self.live = LiveDiagnosis(cfg, self.writer, self.metrics, self.live_worker, self._stop, self._pool)
        self.recording = Recording(cfg, self.writer, self.metrics, self.live_worker, self._stop, self._pool,
                                   open_incidents=self.live.open_incidents, identify=identify)
        self.report = ReportPage(cfg, self.writer)
        self._runners: list[Any] = []
        self._grpc: Any = None  # the OTLP/gRPC receiver's grpc.aio server
        self._proxy_server: Any = None
        self._relay_workers: Any = None  # relay_workers.RelayWorkers with --workers N > 1

    # -- lifecycle ----------------------------------------------------------------------
    async def _start_http(self) -> None:
        from aiohttp import web

        if self.cfg.listen:
            host, port = host_port(self.cfg.listen, 9400, "--listen")
            app = make_app(self.metrics, lambda: [i.to_json() for i in self.live.incidents], self.recording.health,
                           self.report.page, self.cfg.token)
            await self._site(web, app, host, port, "endpoints")
        if self.cfg.proxy:
            from ..collect.proxy import make_proxy

            host, port = host_port(self.cfg.proxy, 9000, "--proxy")
            server = make_proxy(self.cfg.server_url, self.recording, store_text=self.cfg.store_text)
            self.live.proxy = server.proxy
            more = self.cfg.proxy_workers - 1
            try:
                await server.start(host, port, reuse_port=more > 0)
            except OSError as e:
                raise InputError(f"proxy: cannot listen on {host}:{port} ({e.strerror or e}); "
                                 "choose another HOST:PORT") from None
            self._proxy_server = server
            if more:  # relay processes beside this one, on the same address (relay_workers.py)
                from .relay_workers import Relays, RelayWorkers

                self._relay_workers = RelayWorkers(more, self.cfg.server_url, host, server.port, self.cfg.store_text,
                                                   self.recording, server.proxy.server_label, SHUTDOWN_GRACE_S)
                await self._relay_workers.start()
                self.live.proxy = Relays(server.proxy, self._relay_workers)
            log.info("proxy listening on http://%s:%d%s", host, server.port,
                     f" ({self.cfg.proxy_workers} relay processes)" if more else "")
        if self.cfg.otlp_receiver:
            from ..collect.otlp_receiver import make_app as make_receiver

            host, port = host_port(self.cfg.otlp_receiver, 4318, "--otlp-receiver")
            await self._site(web, make_receiver(self.recording), host, port, "otlp")
        if self.cfg.otlp_grpc_receiver:
            from ..collect.otlp_grpc import DEFAULT_PORT, start_grpc_receiver

            host, port = host_port(self.cfg.otlp_grpc_receiver, DEFAULT_PORT)
            self._grpc, _, bound = await start_grpc_receiver(self.recording, host, port)
            log.info("otlp-grpc listening on %s:%d", host, bound)

    async def _site(self, web, app, host: str, port: int, what: str) -> None:
        # auto_decompress off: the OTLP receiver inflates itself (and bounds what it inflates)
        # shutdown_timeout: a request still open at SIGTERM is cut after this, not waited on for a minute
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

    def capture_problem(self) -> str | None:
        """After :meth:`run`: why the capture is incomplete (records dropped, meta not written), or None."""
        return self.recording.capture_problem()

    def _on_signal(self) -> None:
        if self._stop.is_set():  # a second Ctrl-C / SIGTERM: the operator means now
            log.warning("second signal: exiting without waiting")
            os._exit(EXIT_INTERRUPTED)
        log.info("stopping: closing the capture")
        self.stop()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests) or Windows
                pass
        if self.cfg.otlp_endpoint:
            from .otel_export import OtelExport

            self.live.otel = OtelExport(self.cfg.otlp_endpoint)
        try:
            await self._start_http()
            if self.cfg.gc_between_requests:
                from ..idle_gc import IdleCollector

                self.recording.idle_gc = IdleCollector(busy=lambda: self._proxy_server is not None
                                                       and self._proxy_server.busy)
                self.recording.idle_gc.start(loop)
            identify = self.recording.identify
            polled = self.cfg.collectors + ([identify] if identify is not None else [])
            tasks = [asyncio.create_task(self.recording.poll(c)) for c in polled]
            tasks.append(asyncio.create_task(self.live.run()))
            if self.cfg.duration_s:
                loop.call_later(self.cfg.duration_s, self.stop)
            await self._stop.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if self.recording.idle_gc is not None:
                self.recording.idle_gc.close()
            if self._proxy_server is not None:
                closing = [self._proxy_server.close(SHUTDOWN_GRACE_S)]
                if self._relay_workers is not None:  # their last records come in before the capture closes
                    closing.append(self._relay_workers.close())
                await asyncio.gather(*closing)
            for runner in self._runners:
                await runner.cleanup()
            if self._grpc is not None:
                await self._grpc.stop(1.0)
            try:
                self.live.diagnose_now()
            except Exception:
                log.exception("final diagnosis failed")
            if self.live.otel:
                self.live.otel.shutdown()
            self._pool.shutdown(wait=False, cancel_futures=True)
            for c in self.cfg.collectors:
                close = getattr(c, "close", None)
                if close is not None:
                    close()
            self.live_worker.close()
            self.report.close()
            self.recording.flush_meta()
            self.writer.close()



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
