"""The agent's /report page: the capture so far diagnosed and rendered in a process of its own,
one render at a time, reused until new records arrive and, under steady traffic, for
REPORT_REUSE_S (the page says when it was rendered)."""
from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..capture import QueuedWriter
from ..diagnosis import Options, Rule
from ..workers import stop_pool, worker_pool

REPORT_TIMEOUT_S = 120.0
#: a page is reused this long even when records arrived since: a render is a second or more of a
#: core (load, diagnose, plot), and on a busy server every request adds records, so a dashboard
#: polling /report every second would keep a core rendering beside the engine and the proxy
REPORT_REUSE_S = 10.0


@dataclass(frozen=True)
class RenderedPage:
    """/report's page as bytes, made in the render process: the loop only writes them out (the
    page is ~5 MB with plotly inlined; encoding it was ~5 ms of the loop's time per request)."""
    html_utf8: bytes
    html_gzip: bytes


class ReportPage:
    """The agent's /report: ``page()`` renders the capture so far (``writer``'s, the agent's)."""

    def __init__(self, cfg: Any, writer: QueuedWriter) -> None:
        self.cfg = cfg  # AttachConfig
        self.writer = writer
        self.reports_rendered = 0
        self.report_reuse_s = REPORT_REUSE_S
        self._report_lock = threading.Lock()
        self._report_cache: tuple[int, float, RenderedPage] | None = None  # (records at render, monotonic time, page)
        self._render_pool: concurrent.futures.ProcessPoolExecutor | None = None

    def close(self) -> None:
        if self._render_pool is not None:
            stop_pool(self._render_pool)
            self._render_pool = None

    def page(self) -> RenderedPage | None:
        """The page (None without plotly), rendered anew only when records arrived and the last
        one is older than ``report_reuse_s``."""
        try:
            import plotly  # noqa: F401  (the report's one optional dependency)
        except ImportError:
            return None

        with self._report_lock:  # one render at a time
            self.writer.flush()  # every queued record on disk first
            key, now = sum(self.writer.counts.values()), time.monotonic()
            if self._report_cache is not None:
                n, at, page = self._report_cache
                if n == key or now - at < self.report_reuse_s:
                    return page
            # in a process of its own: rendering is seconds of Python, and in a thread it would
            # hold the GIL the proxy relays with (measured: hundreds of ms added to TTFT P99)
            if self._render_pool is None:
                self._render_pool = worker_pool()
            try:
                html = self._render_pool.submit(_render_report, str(self.cfg.capture_dir), self.cfg.rules,
                                                self.cfg.options).result(timeout=REPORT_TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                # the render may be stuck for good: end it, or every later render queues behind it
                stop_pool(self._render_pool, kill=True)
                self._render_pool = None
                raise
            self._report_cache = (key, time.monotonic(), html)
            self.reports_rendered += 1
            return html


def _render_report(capture_dir: str, rules: list[Rule], options: Options) -> RenderedPage:
    """/report's page, in the render process."""
    import gzip

    from ..capture import load
    from ..diagnosis import diagnose
    from ..report.html import render_html

    html = render_html(diagnose(load(capture_dir), rules, options)).encode()
    return RenderedPage(html, gzip.compress(html, compresslevel=6))
