"""Engine metrics: scrape ``/metrics``, map to neutral names, read engine config, and notice
when the server goes down, comes back, or restarts (its counters fall back)."""
from __future__ import annotations

import concurrent.futures
import http.client
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
from typing import Any

import orjson

from ..engines import llamacpp_config_from_props, parse_scrape
from ..engines.vllm import vllm_config_from_models
from ..errors import InputError
from ..model import EngineSample, Event
from ..workers import stop_pool, worker_pool
from .base import SourceUnavailable

log = logging.getLogger(__name__)

#: counters whose fall means the engine restarted (any one present suffices)
RESTART_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "request_success_total", "requests_total")
CONFIG_EVERY_S = 30.0


#: a /metrics, /props or /slots answer larger than this is refused unread (a real one is far smaller)
MAX_BODY_BYTES = 16 << 20


class BodyTooLarge(OSError):
    pass


def http_get(url: str, timeout_s: float, max_bytes: int = MAX_BODY_BYTES) -> tuple[int, bytes]:
    """GET with a *total* deadline: a server that drips its answer a byte at a time (every
    socket read on time, the whole answer never) is cut off at ``timeout_s`` all the same, so
    a scrape can neither stall the loop nor hold up shutdown. Raises TimeoutError past the
    deadline, BodyTooLarge past ``max_bytes``, OSError when the server cannot be reached."""
    u = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = cls(u.hostname or "127.0.0.1", u.port, timeout=timeout_s)
    expired = threading.Event()

    def cut() -> None:  # unblocks whatever read is waiting, at the deadline
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout_s, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.request("GET", (u.path or "/") + (f"?{u.query}" if u.query else ""),
                     headers={"Accept": "text/plain, application/json", "Connection": "close"})
        resp = conn.getresponse()
        declared = resp.getheader("Content-Length")
        if declared and declared.isdigit() and int(declared) > max_bytes:
            raise BodyTooLarge(f"answer of {int(declared)} bytes is over the {max_bytes >> 20} MiB limit")
        chunks, total = [], 0
        while chunk := resp.read1(1 << 16):
            total += len(chunk)
            if total > max_bytes:
                raise BodyTooLarge(f"answer is over the {max_bytes >> 20} MiB limit")
            chunks.append(chunk)
        if expired.is_set():
            raise TimeoutError(f"timed out: no whole answer within {timeout_s:g} s")
        return resp.status, b"".join(chunks)
    except (OSError, http.client.HTTPException) as e:
        if expired.is_set():
            raise TimeoutError(f"timed out: no whole answer within {timeout_s:g} s") from None
        if isinstance(e, OSError):
            raise
        raise OSError(f"malformed HTTP answer ({type(e).__name__}: {e})") from None
    finally:
        timer.cancel()
        conn.close()


#: a server is taken as down after a refused connection, or after this many /metrics timeouts in a row
DOWN_AFTER_TIMEOUTS = 3


#: the longest one scrape waits for the worker's parse before parsing the page here instead: a
#: worker at its lower priority beside an engine that keeps every core busy can take seconds (a
#: fresh one tens of seconds to import), and a scrape that waited 30 s for it lost the engine's
#: gauges for the whole of a 45 s overload (CI: requests_waiting read 0 through a 6 s queue)
PARSE_WAIT_S = 1.0
#: a worker still busy with one page after this long is taken as stuck, ended and replaced; until
#: then it is left to finish (starved, not stuck) and the scrapes meanwhile parse here
PARSE_TIMEOUT_S = 30.0


class ScrapeCollector:
    """An engine's ``/metrics`` every ``interval_s``. ``parse_in_process``: parse the page in a
    worker process (kvdoctor.workers), as ``kvdoctor attach`` does: a vLLM page is ~650 lines,
    ~15 ms of Python a scrape, and in this thread it would hold the GIL the proxy relays with
    (benchmarks/bench_proxy.py part B: added TTFT P99 4.8 ms instead of 1.9 ms)."""

    name = "scrape"

    def __init__(self, base_url: str, interval_s: float = 1.0, timeout_s: float = 2.0, server: str | None = None,
                 parse_in_process: bool = False):
        self.parse_in_process = parse_in_process
        self._parse_pool: Any = None
        self._busy: tuple[concurrent.futures.Future, float] | None = None  # (unfinished parse, since)
        self._slow_said = False
        self.base_url = base_url.rstrip("/")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.server = server or self.base_url
        self.engine: str | None = None
        self.config: dict[str, Any] = {}
        self._up: bool | None = None
        self._timeouts = 0  # /metrics timeouts in a row
        self._last_counters: dict[str, float] = {}
        self._config_at = 0.0
        self._props_warned = False

    def collect(self, now_s: float) -> list[Any]:
        out: list[Any] = []
        try:
            status, body = http_get(f"{self.base_url}/metrics", self.timeout_s)
        except BodyTooLarge as e:  # the server answered: it is up, but the page is not read
            raise SourceUnavailable(f"{self.base_url}/metrics: {e}; not parsed", out) from None
        except (OSError, urllib.error.URLError) as e:
            reason = getattr(e, "reason", e)
            # a server busy with a long prefill can answer /metrics late (llama.cpp serves it
            # from the same task loop): only a refused connection, or timeouts in a row, mean down
            slow = isinstance(reason, TimeoutError) or "timed out" in str(reason)
            self._timeouts = self._timeouts + 1 if slow else 0
            if self._up is not False and (not slow or self._timeouts >= DOWN_AFTER_TIMEOUTS):
                out.append(Event(time_s=now_s, kind="server-down", server=self.server, detail={"reason": str(e)[:200]}))
                self._up = False
            raise SourceUnavailable(f"server unreachable at {self.base_url}: {reason}", out) from None
        self._timeouts = 0
        if self._up is False:
            out.append(Event(time_s=now_s, kind="server-up", server=self.server))
        self._up = True
        if status in (404, 501):
            out += self._config(now_s, force=False)
            raise SourceUnavailable(f"{self.base_url}/metrics answered {status}: metrics are off "
                                    "(llama-server needs --metrics; SGLang --enable-metrics)", out)
        if status != 200:
            raise SourceUnavailable(f"{self.base_url}/metrics answered HTTP {status}", out)
        try:
            sample, config, engine = self._parse(body.decode("utf-8", "replace"), now_s)
        except InputError as e:
            raise SourceUnavailable(f"could not parse {self.base_url}/metrics: {e}", out) from None
        self.engine = engine or self.engine
        if self._restarted(sample):
            out.append(Event(time_s=now_s, kind="server-restart", server=self.server,
                             detail={"reason": "engine counters fell back"}))
            self._config_at = 0.0
        if config and any(self.config.get(k) != v for k, v in config.items()):
            self.config.update(config)
            # the metric names say which engine this is (vllm:, sglang:, ...): the capture's meta records it
            named = {"engine": engine} if engine and engine != "dcgm" else {}
            out.append(Event(time_s=now_s, kind="config", server=self.server, detail={**config, **named}))
        out += self._config(now_s, force=False)
        out.append(sample)
        return out

    def _parse(self, text: str, now_s: float) -> tuple[EngineSample, dict[str, Any], str | None]:
        if not self.parse_in_process:
            return parse_scrape(text, now_s, self.server)
        if self._busy is not None:  # the worker has not finished an earlier page
            fut, since = self._busy
            if not fut.done():
                if time.monotonic() - since > PARSE_TIMEOUT_S:
                    log.warning("%s/metrics: the parse worker has been stuck for %.0f s; ended, a new one "
                                "starts with the next scrape", self.base_url, time.monotonic() - since)
                    self.close(kill=True)  # a stuck worker may never return: ended, not left running
                return parse_scrape(text, now_s, self.server)
            self._busy = None
        if self._parse_pool is None:
            self._parse_pool = worker_pool()
        fut = None
        try:
            fut = self._parse_pool.submit(parse_scrape, text, now_s, self.server)
            return fut.result(timeout=PARSE_WAIT_S)
        except concurrent.futures.TimeoutError:
            # starved or still starting: this page is parsed here, and so is every page until it is done
            self._busy = (fut, time.monotonic())
            if not self._slow_said:
                log.warning("%s/metrics: the parse worker is slow (busy cores?); parsing in the sidecar while "
                            "it is (said once)", self.base_url)
                self._slow_said = True
            return parse_scrape(text, now_s, self.server)
        except concurrent.futures.process.BrokenProcessPool:
            # the worker died: this page is parsed here, the next in a new worker
            log.warning("%s/metrics: the parse worker failed (it died); parsing in the sidecar this once",
                        self.base_url)
            self.close(kill=True)
            return parse_scrape(text, now_s, self.server)

    def close(self, kill: bool = False) -> None:
        """Stop the parse worker, if one was started (the next scrape starts another); ``kill``:
        at once, even mid-parse."""
        pool, self._parse_pool, self._busy = self._parse_pool, None, None
        if pool is not None:
            stop_pool(pool, kill)

    def _vllm_config(self, now_s: float, force: bool) -> list[Any]:
        """``max_model_len`` from /v1/models: vLLM's /metrics does not carry the context limit."""
        if not force and time.monotonic() - self._config_at < CONFIG_EVERY_S:
            return []
        self._config_at = time.monotonic()
        try:
            status, body = http_get(f"{self.base_url}/v1/models", self.timeout_s)
            cfg = vllm_config_from_models(orjson.loads(body)) if status == 200 else {}
        except (OSError, urllib.error.URLError, orjson.JSONDecodeError):
            return []
        if not cfg or all(self.config.get(k) == v for k, v in cfg.items()):
            return []
        self.config.update(cfg)
        return [Event(time_s=now_s, kind="config", server=self.server, detail=dict(cfg))]

    def _restarted(self, sample: EngineSample) -> bool:
        fell = False
        for name in RESTART_COUNTERS:
            v = sample.values.get(name)
            if v is None:
                continue
            prev = self._last_counters.get(name)
            if prev is not None and v < prev:
                fell = True
            self._last_counters[name] = v
        return fell

    def _config(self, now_s: float, force: bool) -> list[Any]:
        """llama.cpp's /props and /slots, vLLM's /v1/models (read every CONFIG_EVERY_S, and after a restart)."""
        if self.engine == "vllm":
            return self._vllm_config(now_s, force)
        if self.engine not in (None, "llamacpp") or (not force and time.monotonic() - self._config_at < CONFIG_EVERY_S):
            return []
        self._config_at = time.monotonic()
        try:
            s1, props = http_get(f"{self.base_url}/props", self.timeout_s)
            s2, slots = http_get(f"{self.base_url}/slots", self.timeout_s)
        except (OSError, urllib.error.URLError):
            return []
        if s1 != 200:
            return []
        try:
            cfg = llamacpp_config_from_props(orjson.loads(props), orjson.loads(slots) if s2 == 200 else None)
        except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError, OverflowError) as e:
            if not self._props_warned:  # odd /props (a 1e300, a string n_ctx): said once, scraping goes on
                log.warning("%s/props: config not read (%s: %s)", self.base_url, type(e).__name__, str(e)[:200])
                self._props_warned = True
            return []
        cfg.pop("slot_n_ctx", None)
        if self.engine is None:
            self.engine = "llamacpp"
        if all(self.config.get(k) == v for k, v in cfg.items()):
            return []
        self.config.update(cfg)
        return [Event(time_s=now_s, kind="config", server=self.server, detail={**cfg, "engine": "llamacpp"})]
