"""A small Prometheus HTTP API client (stdlib only): auth, TLS, timeouts, accounting.

Every call is counted (``queries``) and its response body measured (``bytes``) so the fleet
benchmark and the CLI can say what a diagnosis cost the Prometheus server. A failed call raises
:class:`PromError` naming the query and the reason; callers turn it into a warning and go on.
"""
from __future__ import annotations

import base64
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import orjson


class PromError(Exception):
    def __init__(self, query: str, reason: str):
        super().__init__(f"query {query!r} failed: {reason}")
        self.query, self.reason = query, reason


@dataclass
class PromClient:
    url: str
    bearer_token: str | None = None
    basic_auth: str | None = None  # "user:pass"
    ca_file: str | None = None
    insecure: bool = False
    timeout_s: float = 60.0
    queries: int = 0
    bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self._ctx: ssl.SSLContext | None = None
        if self.url.startswith("https://"):
            self._ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.insecure:
                self._ctx.check_hostname = False
                self._ctx.verify_mode = ssl.CERT_NONE

    def _headers(self) -> dict[str, str]:
        h = {"Accept": "application/json", "User-Agent": "kvdoctor-fleet"}
        if self.bearer_token:
            h["Authorization"] = f"Bearer {self.bearer_token}"
        elif self.basic_auth:
            h["Authorization"] = "Basic " + base64.b64encode(self.basic_auth.encode()).decode()
        return h

    def get(self, path: str, params: dict[str, Any] | list[tuple[str, Any]], what: str, post: bool = True) -> Any:
        """POST the form to ``/api/v1/<path>`` (long selectors do not fit a URL; label values
        endpoints are GET only); the ``data`` of a ``success`` answer, else PromError(what, reason)."""
        body = urllib.parse.urlencode(params, doseq=True)
        if post:
            headers = {**self._headers(), "Content-Type": "application/x-www-form-urlencoded"}
            req = urllib.request.Request(f"{self.url}/api/v1/{path}", data=body.encode(), headers=headers, method="POST")
        else:
            req = urllib.request.Request(f"{self.url}/api/v1/{path}?{body}", headers=self._headers(), method="GET")
        with self._lock:
            self.queries += 1
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ctx) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raw = e.read() or b""
            with self._lock:
                self.bytes += len(raw)
            raise PromError(what, f"HTTP {e.code}: {_error_text(raw) or e.reason}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise PromError(what, f"cannot reach {self.url}: {reason}") from None
        with self._lock:
            self.bytes += len(raw)
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise PromError(what, "answer is not JSON (is this the Prometheus base URL?)") from None
        if doc.get("status") != "success":
            raise PromError(what, f"{doc.get('errorType', 'error')}: {doc.get('error', 'unknown')}")
        return doc.get("data")

    def label_values(self, label: str, match: list[str], start: float, end: float) -> list[str]:
        return self.get(f"label/{label}/values", [("match[]", m) for m in match] +
                        [("start", f"{start:.3f}"), ("end", f"{end:.3f}")], f"GET label/{label}/values", post=False) or []

    def query_range(self, query: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        data = self.get("query_range", {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                        "step": f"{step_s:g}"}, query)
        if not isinstance(data, dict) or data.get("resultType") != "matrix":
            raise PromError(query, f"expected a matrix, got {type(data).__name__}")
        return data.get("result") or []


    def scrape_interval_s(self) -> float | None:
        """The shortest scrape interval among the server's active targets (``/api/v1/targets``),
        or None when the server does not say (a Prometheus-compatible store without targets)."""
        from ..timeparse import parse_duration

        data = self.get("targets", {"state": "active"}, "GET targets", post=False)
        got = []
        for t in (data or {}).get("activeTargets") or ():
            try:
                got.append(parse_duration(str(t.get("scrapeInterval", ""))))
            except ValueError:
                continue
        return min(got) if got else None


def _error_text(raw: bytes) -> str:
    try:
        doc = orjson.loads(raw)
        return f"{doc.get('errorType', '')}: {doc.get('error', '')}".strip(": ")
    except Exception:
        return raw[:200].decode("utf-8", "replace").strip()
