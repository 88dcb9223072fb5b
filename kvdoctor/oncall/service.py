"""`kvdoctor oncall`: an Alertmanager webhook receiver that turns a bare page into a diagnosed one.

Alertmanager posts (webhook payload version 4) every alert of a group each time the group is
notified; an alert is keyed by its ``fingerprint``: a firing alert seen before is a repeat
(dropped), a resolved one is closed. A new firing alert queues a diagnosis of
its instance (diagnose.py); alerts of an instance that is already queued join that diagnosis
(coalesced), the queue is bounded (``queue_max`` instances) and ``workers`` diagnoses run at a
time, so a burst of 100 alerts costs one diagnosis per instance, not 100 in parallel. Each
summary goes to the ``--forward-webhook`` URLs as Slack-compatible ``{"text": ...}`` and stays
at ``/incidents``; the HTML report at ``/report/ID``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ..errors import InputError
from ..units import duration_text
from ..timeparse import epoch_or_iso, iso_utc
from .diagnose import Result, Setup, diagnose_instance

log = logging.getLogger("kvdoctor.oncall")
KEEP_CLOSED = 500  # resolved alerts kept at /incidents


@dataclass
class Alert:
    """One Alertmanager alert (keyed by its fingerprint) and the diagnosis of its instance; not a
    kvdoctor incident (:class:`kvdoctor.diagnosis.Incident`), which the diagnosis may find."""

    id: int
    fingerprint: str
    alertname: str
    instance: str
    severity: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_s: float
    status: str = "firing"          # firing | resolved
    diagnosis: str = "queued"       # queued | running | done | unavailable | skipped
    resolved_s: float | None = None
    top_rule: str | None = None
    summary: str | None = None
    html: str | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "fingerprint": self.fingerprint, "alertname": self.alertname, "instance": self.instance,
                "severity": self.severity, "status": self.status, "starts": iso_utc(self.starts_s),
                "resolved": iso_utc(self.resolved_s) if self.resolved_s else None, "diagnosis": self.diagnosis,
                "top_rule": self.top_rule, "summary": self.summary, "labels": self.labels,
                "report": f"/report/{self.id}" if self.html else None}


def parse_payload(body: Any) -> list[dict[str, Any]]:
    """The alerts of an Alertmanager webhook payload (version 4); InputError naming the field otherwise."""
    if not isinstance(body, dict):
        raise InputError("payload: expected a JSON object (Alertmanager webhook, version 4)")
    if str(body.get("version", "")) != "4":
        raise InputError(f"payload.version: expected \"4\" (Alertmanager webhook), got {body.get('version')!r}")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise InputError("payload.alerts: expected a list")
    for i, a in enumerate(alerts):
        if not isinstance(a, dict) or not isinstance(a.get("labels"), dict) or not a.get("fingerprint"):
            raise InputError(f"payload.alerts[{i}]: expected an object with labels and fingerprint")
        if a.get("status") not in ("firing", "resolved"):
            raise InputError(f"payload.alerts[{i}].status: expected firing or resolved, got {a.get('status')!r}")
    return alerts


class OnCall:
    def __init__(self, setup: Setup, forward: tuple[str, ...] = (), public_url: str = "", queue_max: int = 32,
                 workers: int = 1):
        self.setup, self.forward, self.public_url = setup, forward, public_url.rstrip("/")
        self.queue_max, self.workers = queue_max, workers
        self.alerts: dict[str, Alert] = {}
        self.by_id: dict[int, Alert] = {}
        self.pending: dict[str, list[str]] = {}  # instance -> fingerprints waiting for its diagnosis
        self.queue: asyncio.Queue[str] | None = None
        self.stats = {"alerts": 0, "repeats": 0, "coalesced": 0, "diagnoses": 0, "running": 0, "max_running": 0,
                      "skipped_queue_full": 0, "posted": 0, "post_failures": 0}
        self.posts: list[str] = []  # texts posted, newest last (bounded)
        self._next = 1
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.queue = asyncio.Queue(maxsize=self.queue_max)
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(max(1, self.workers))]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- alerts in -------------------------------------------------------------------------
    async def receive(self, body: Any) -> dict[str, int]:
        alerts = parse_payload(body)
        new = closed = 0
        for a in alerts:
            self.stats["alerts"] += 1
            fp = str(a["fingerprint"])
            alert = self.alerts.get(fp)
            if a["status"] == "resolved":
                if alert is not None and alert.status == "firing":
                    alert.status, alert.resolved_s = "resolved", _time(a.get("endsAt")) or time.time()
                    closed += 1
                    await self._post(self._resolved_text(alert))
                continue
            if alert is not None and alert.status == "firing":
                self.stats["repeats"] += 1
                continue
            alert = self._open(fp, a)
            new += 1
            self._enqueue(alert)
        self._trim()
        return {"alerts": len(alerts), "new": new, "resolved": closed}

    def _open(self, fp: str, a: dict[str, Any]) -> Alert:
        labels = {str(k): str(v) for k, v in a["labels"].items()}
        instance = _instance(labels, self.setup.group_by)
        alert = Alert(self._next, fp, labels.get("alertname", "?"), instance, labels.get("severity", "?"), labels,
                       {str(k): str(v) for k, v in (a.get("annotations") or {}).items()},
                       _time(a.get("startsAt")) or time.time())
        self._next += 1
        self.alerts[fp] = self.by_id[alert.id] = alert
        return alert

    def _enqueue(self, alert: Alert) -> None:
        assert self.queue is not None
        waiting = self.pending.get(alert.instance)
        if waiting is not None:
            waiting.append(alert.fingerprint)
            self.stats["coalesced"] += 1
            return
        if self.queue.full():
            self.stats["skipped_queue_full"] += 1
            alert.diagnosis = "skipped"
            why = f"not diagnosed: {self.queue_max} instances already wait for a diagnosis"
            alert.summary = self._firing_text(alert, Result(error=why))
            asyncio.get_running_loop().create_task(self._post(alert.summary))
            return
        self.pending[alert.instance] = [alert.fingerprint]
        self.queue.put_nowait(alert.instance)

    # -- diagnoses -------------------------------------------------------------------------
    async def _worker(self) -> None:
        assert self.queue is not None
        while True:
            instance = await self.queue.get()
            fps = self.pending.pop(instance, [])
            firing = [self.alerts[f] for f in fps if f in self.alerts and self.alerts[f].status == "firing"]
            if not firing:
                continue
            for alert in firing:
                alert.diagnosis = "running"
            self.stats["diagnoses"] += 1
            self.stats["running"] += 1
            self.stats["max_running"] = max(self.stats["max_running"], self.stats["running"])
            try:
                res = await asyncio.to_thread(diagnose_instance, self.setup, instance,
                                              min(i.starts_s for i in firing), time.time())
            except Exception as e:  # a bug in a diagnosis must not stop the receiver
                log.exception("diagnosis of %s failed", instance)
                res = Result(error=f"diagnosis failed: {type(e).__name__}: {e}")
            finally:
                self.stats["running"] -= 1
            for alert in firing:
                alert.diagnosis = "done" if res.error is None else "unavailable"
                alert.top_rule, alert.html = res.top_rule, res.html
                alert.summary = self._firing_text(alert, res)
                if alert.status == "firing":
                    await self._post(alert.summary)

    # -- texts out ---------------------------------------------------------------------------
    def _firing_text(self, alert: Alert, res: Result) -> str:
        since = f"since {iso_utc(alert.starts_s)} ({duration_text(max(0.0, time.time() - alert.starts_s))})"
        lines = [f"FIRING {alert.alertname} ({alert.severity}) on {alert.instance} {since}"]
        if alert.annotations.get("summary"):
            lines.append(f"Alert: {alert.annotations['summary']}")
        if res.error:
            lines.append(f"kvdoctor could not diagnose it: {res.error}")
        else:
            lines.append(f"kvdoctor diagnosis of {alert.instance}, {iso_utc(res.start_s)} → {iso_utc(res.end_s)}:")
            lines.append(res.text.rstrip("\n"))
            if res.html:
                lines.append(f"Report: {self.public_url}/report/{alert.id}")
        if alert.annotations.get("runbook_url"):
            lines.append(f"Runbook: {alert.annotations['runbook_url']}")
        return "\n".join(lines)

    @staticmethod
    def _resolved_text(alert: Alert) -> str:
        span = duration_text(max(0.0, (alert.resolved_s or time.time()) - alert.starts_s))
        cause = f"; kvdoctor's top cause was {alert.top_rule}" if alert.top_rule else ""
        return f"RESOLVED {alert.alertname} on {alert.instance} (firing {span}){cause}"

    async def _post(self, text: str) -> None:
        import aiohttp

        self.posts = (self.posts + [text])[-200:]
        log.warning("%s", text)
        for url in self.forward:
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                    async with s.post(url, json={"text": text}) as resp:
                        if resp.status >= 300:
                            raise RuntimeError(f"HTTP {resp.status}")
                self.stats["posted"] += 1
            except Exception as e:
                self.stats["post_failures"] += 1
                log.warning("forward to %s failed: %s", url, e)

    def _trim(self) -> None:
        closed = [i for i in self.alerts.values() if i.status == "resolved"]
        for alert in sorted(closed, key=lambda i: i.id)[:max(0, len(closed) - KEEP_CLOSED)]:
            self.alerts.pop(alert.fingerprint, None)
            self.by_id.pop(alert.id, None)

    # -- views -------------------------------------------------------------------------------
    def alerts_json(self) -> list[dict[str, Any]]:
        return [i.to_json() for i in sorted(self.alerts.values(), key=lambda i: -i.id)]

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "prometheus": self.setup.prometheus, "queued": len(self.pending),
                "open": sum(i.status == "firing" for i in self.alerts.values()), **self.stats}


def _instance(labels: dict[str, str], group_by: str) -> str:
    """The engine instance an alert is about: the sidecar's alert (KvdoctorIncidentActive) names
    the server it watches in ``server`` (a URL); its own ``instance`` is the sidecar's address."""
    server = labels.get("server", "")
    if "://" in server and urlsplit(server).netloc:
        return urlsplit(server).netloc
    return labels.get(group_by) or server or "unknown"


def _time(v: Any) -> float | None:
    """Alertmanager's RFC 3339 times; its zero time (0001-01-01) means unset."""
    if not v or str(v).startswith("0001-"):
        return None
    return epoch_or_iso(str(v))


def make_app(oncall: OnCall, token: str | None = None):
    import orjson
    from aiohttp import web

    from ..sidecar.serve import bearer_auth

    def dumps(o):
        return orjson.dumps(o).decode()

    async def webhook(request: web.Request) -> web.Response:
        try:
            body = await request.json(loads=orjson.loads)
        except (ValueError, orjson.JSONDecodeError):
            return web.json_response({"error": "body is not JSON"}, status=400)
        try:
            done = await oncall.receive(body)
        except InputError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(done, dumps=dumps)

    async def incidents(_r: web.Request) -> web.Response:
        return web.json_response({"incidents": oncall.alerts_json()}, dumps=dumps)

    async def healthz(_r: web.Request) -> web.Response:
        return web.json_response(oncall.health(), dumps=dumps)

    async def report(request: web.Request) -> web.Response:
        try:
            alert = oncall.by_id.get(int(request.match_info["id"]))
        except ValueError:
            alert = None
        if alert is None or not alert.html:
            return web.Response(status=404, text="no report for this incident (unknown, or not diagnosed)\n")
        return web.Response(text=alert.html, content_type="text/html")

    app = web.Application(middlewares=[bearer_auth(token)], client_max_size=8 * 2**20)
    app.router.add_post("/alertmanager", webhook)
    app.router.add_post("/", webhook)
    app.router.add_get("/incidents", incidents)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/report/{id}", report)
    return app
