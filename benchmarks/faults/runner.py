"""Run one fault of the zoo on a real server with kvdoctor attached (live diagnosis on), then
diagnose the capture offline; returns a JSON-ready record. The label is the fault's construction
(``zoo.Fault.expect``); nothing here reads kvdoctor's verdict to decide what the fault was."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np

import kvdoctor
from harness import loadgen, nginx
from harness.llama_server import LlamaServer
from harness.scenarios import AttachedAgent, hogs, quality_prompts
from harness.tiering import ROUTER
from kvdoctor.diagnosis import Options, diagnose

from .zoo import LLAMACPP, VLLM, VLLM_SERVERS, Fault, cut

#: the deployment's stated objectives, per engine, on this CPU: vLLM in float32 (no native bf16
#: on an AVX2-only CPU) decodes one stream at 65-150 ms a token, over the chat default's 100 ms
#: TPOT P99 with nobody at fault, so that deployment states 250 ms; llama.cpp keeps the defaults
def stated_slo(engine: str, vllm_dtype: str | None) -> dict:
    return {"tpot_p99_s": 0.25} if engine == VLLM and vllm_dtype == "float32" else {}


class ServerPool:
    """The vLLM servers runs share, one running at a time (a start costs 1-2 min here)."""

    def __init__(self, log=print):
        self.log, self.key, self.srv = log, None, None
        self.starts = 0

    def get(self, key: str):
        from harness.vllm_server import VllmServer

        if self.key == key and self.srv is not None and self.srv.running:
            return self.srv
        self.close()
        t = time.monotonic()
        self.srv = VllmServer(**VLLM_SERVERS[key]).start()
        self.key, self.starts = key, self.starts + 1
        self.log(f"  vLLM '{key}' server started in {time.monotonic() - t:.0f} s")
        return self.srv

    def discard(self) -> None:
        self.close()

    def close(self) -> None:
        if self.srv is not None:
            self.srv.stop()
        self.key = self.srv = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _incident_json(inc, now_s: float | None = None) -> dict:
    # the worst broken objective's burn rate: the lead between incidents that tie otherwise (lead_key)
    burn = inc.burn_rate
    return {"start_s": inc.start_s, "end_s": inc.end_s, "severity": inc.severity, "observation": bool(inc.observation),
            "symptom": inc.symptom, "opened_s": now_s, "burn_rate": None if burn is None else round(float(burn), 2),
            "causes": [{"rule": c.rule.id, "kind": c.rule.kind, "title": c.cause, "confidence": c.confidence}
                       for c in inc.causes]}


def client_harm(timings: list[dict], slo: dict) -> dict:
    """What the client itself measured against the run's objectives (the chat defaults, then the
    stated ones): TTFT and TPOT P99 over completed requests, the error rate without the client's
    own give-ups. Independent of kvdoctor's rules: the ground truth for "was anyone hurt"."""
    from kvdoctor.objectives import WORKLOADS

    objectives = {**WORKLOADS["chat"], **slo}
    ok = [t for t in timings if t["status"] == "ok"]
    # the client's own give-ups, and requests the load generator cancelled at its deadline (never
    # sent, or cut by the harness): neither is the server failing a request
    gave_up = sum(1 for t in timings if t["status"] != "ok" and (t.get("error") or "").startswith(
        ("client gave up", "cancelled: run exceeded")))
    ttft = [t["ttft_s"] for t in ok if t.get("ttft_s") is not None]
    tpot = [t["tpot_s"] for t in ok if t.get("tpot_s") is not None]
    n = len(timings) - gave_up
    got = {"ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
           "tpot_p99_s": float(np.percentile(tpot, 99)) if tpot else None,
           "error_rate": (len(timings) - len(ok) - gave_up) / n if n else None}
    broken = sorted(k for k, v in got.items() if v is not None and k in objectives and v > objectives[k])
    return {**{k: None if v is None else round(v, 4) for k, v in got.items()}, "objectives": objectives,
            "broken": broken}


def _engine_config(fault: Fault, engine: str) -> dict:
    return {"max_running_requests": VLLM_SERVERS[fault.vllm]["max_num_seqs"]} if engine == VLLM else {}


GATE = """
    limit_req_zone $binary_remote_addr zone=kvd_rl:1m rate={rate};
    server {{
        listen 127.0.0.1:{port};
        location /v1/ {{
            limit_req zone=kvd_rl burst={burst} nodelay;
            limit_req_status 429;
            proxy_pass http://127.0.0.1:{upstream};
            proxy_buffering off;
        }}
        location / {{ proxy_pass http://127.0.0.1:{upstream}; }}
    }}"""

#: affinity by a plain hash of the tenant (not ``consistent``: ketama places keys by the servers' addresses, so
#: with random ports three tenants could all land on one replica); tenants 0 and 2 go to one, 1 to the other
POLICIES = {"round-robin": "", "affinity": "hash $http_x_tenant;"}


def _llama(fault: Fault, **over) -> LlamaServer:
    cfg = {**fault.llama, **over}
    return LlamaServer(list(cfg.pop("extra_args", ())), **cfg)


def _warm(fault: Fault, urls) -> None:
    """One request of each tenant on every replica, straight to it (not through the router or
    kvdoctor): the load then starts with every prefix cached everywhere, and a slow first token is
    a routing miss, not a cold start."""
    first: dict[str, object] = {}
    for r in fault.loads[0].requests():
        first.setdefault(r.headers["X-Tenant"], r)
    reqs = list(first.values())

    async def both():
        return await asyncio.gather(*(loadgen.run_load(u, reqs, 1, timeout_s=120) for u in urls))

    for timings in asyncio.run(both()):
        bad = [t.error for t in timings if t.status != "ok"]
        if bad:
            raise RuntimeError(f"warming a replica failed: {bad[0]}")


@contextlib.contextmanager
def _front(fault: Fault, engine: str, pool: ServerPool):
    """(url kvdoctor attaches to, engine pid, scrape?, server) for the fault's kind."""
    with contextlib.ExitStack() as stack:
        if fault.kind == "routing":
            a = stack.enter_context(_llama(fault))
            b = stack.enter_context(_llama(fault))
            _warm(fault, (a.url, b.url))
            port = stack.enter_context(nginx.running(lambda p: ROUTER.format(
                policy=POLICIES[fault.params["route"]], a=a.port, b=b.port, port=p)))
            if port is None:
                raise RuntimeError("nginx is not installed (scripts/install-services installs nginx-light)")
            yield f"http://127.0.0.1:{port}", None, False, a
            return
        srv = pool.get(fault.vllm) if engine == VLLM else stack.enter_context(_llama(fault))
        url, pid = srv.url, srv.pid
        if fault.kind == "gateway":
            port = stack.enter_context(nginx.running(lambda p: GATE.format(
                rate=fault.params["rate"], burst=fault.params["burst"], upstream=srv.port, port=p)))
            if port is None:
                raise RuntimeError("nginx is not installed (scripts/install-services installs nginx-light)")
            url = f"http://127.0.0.1:{port}"
        elif fault.kind == "leak":
            from .leak_shim import running as shim

            url, pid = stack.enter_context(shim(srv.url, fault.params["leak_kib"]))
        yield url, pid, True, srv


async def _poison(url: str) -> None:
    """vLLM 0.32 on CPU: a seeded request whose prompt is prefilled in chunks kills the engine
    ("CPU Generator does not use offset"); the prompt is longer than the 512-token chunk."""
    body = {"model": "default", "prompt": loadgen.filler_text(900, seed=4242), "max_tokens": 8, "seed": 1234,
            "stream": True}
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
                await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass


def _inject_crash(engine: str, srv, url: str) -> None:
    if engine == LLAMACPP:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(srv.pid, signal.SIGKILL)
    else:
        asyncio.run(_poison(url))


@contextlib.contextmanager
def _watch_live(att, rec: dict, every_s: float = 1.0):
    """When the live diagnosis first named each cause (an incident opens on its first evidence,
    often an objective; its causes join as their holds pass): ``rec["live_first_s"]``, a list of
    [rule, cause title, paging, wall-clock seconds], polled every second."""
    seen: dict = {}
    stop = threading.Event()

    def poll():
        while not stop.wait(every_s):
            now = time.time()
            for inc in list(att.agent.live.incidents):
                paging = not inc.observation and inc.severity in ("warning", "critical")
                for c in inc.causes:
                    seen.setdefault((c.rule.id, c.cause, paging), now)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join(5)
        rec["live_first_s"] = [[r, t, p, s] for (r, t, p), s in sorted(seen.items(), key=lambda kv: kv[1])]


def run_one(fault: Fault, engine: str, out: Path, pool: ServerPool, *, log=print, live_step_s: float = 5.0,
            share: float = 1.0) -> dict:
    """Run ``fault`` on ``engine``; the capture lands in ``out``. The record holds the label
    (the fault's construction), the load's timings, and the live and the offline incidents.
    ``share``: send that share of each load's requests (the quick run; :func:`zoo.cut`)."""
    if out.exists():
        shutil.rmtree(out)
    t0 = time.time()
    rec: dict = {"class": fault.cls, "setting": fault.setting, "engine": engine, "what": fault.what,
                 "expect": [[c.rule, c.says] for c in fault.expect], "capture": str(out)}
    if share < 1.0:
        rec["share"] = share
    if fault.kind == "quality":
        return _run_quality(fault, out, rec, log, share)
    vllm_dtype = None
    opened: list[dict] = []
    timings: list = []
    with _front(fault, engine, pool) as (url, pid, scrape, srv):
        if engine == VLLM:
            vllm_dtype = srv.dtype
        slo = stated_slo(engine, vllm_dtype)
        rec["slo"] = slo
        on_change = lambda what, inc: opened.append({"what": what, "t": time.time(), **_incident_json(inc)})  # noqa: E731
        with AttachedAgent(url, out, pid, _engine_config(fault, engine), step_s=live_step_s, scrape=scrape, slo=slo,
                           on_change=on_change) as att, hogs(fault.hogs), _watch_live(att, rec):
            injector = None
            rec["load_start_s"] = time.time()
            for phase in fault.loads:
                if phase.fault and "fault_start_s" not in rec:
                    rec["fault_start_s"] = time.time()
                    if fault.kind == "crash":
                        # a quick run's load is its share of the full one: the crash comes at the same
                        # share of it (at 15 s it came after a quick load of 12 s had ended)
                        injector = threading.Timer(fault.params["at_s"] * share, lambda: (
                            rec.__setitem__("fault_start_s", time.time()), _inject_crash(engine, srv, att.proxy_url)))
                        injector.start()
                timings += asyncio.run(loadgen.run_load(att.proxy_url, cut(phase.requests(), share), phase.concurrency,
                                                        phase.rate_per_s, timeout_s=180, max_duration_s=1200))
            if injector is not None:
                injector.join()
            rec["load_end_s"] = time.time()
            if fault.kind == "crash":
                time.sleep(3)
                rec["injected"] = not srv.running or srv.health() != 200
            time.sleep(1.5)  # one more scrape after the last request; the agent's last live step runs as it stops
        rec["live"] = [_incident_json(i) for i in att.agent.live.incidents]
    loadgen.write_timings(out / "client-timings.jsonl", timings)
    rec["client"] = client_harm([t.to_dict() for t in timings], rec["slo"])
    if fault.kind == "leak":  # the harm is the memory itself (an OOM ahead), which no latency shows yet
        rec["client"]["broken"] = sorted({*rec["client"]["broken"], "memory"})
    rec["opened"] = [o for o in opened if o["what"] == "opened"]
    rec["requests"] = len(timings)
    rec["ok"] = sum(t.status == "ok" for t in timings)
    diag = diagnose(kvdoctor.load(out), options=Options(slo=dict(rec["slo"])))
    rec["offline"] = [_incident_json(i) for i in diag.incidents]
    rec["wall_s"] = round(time.time() - t0, 1)
    return rec


def _run_quality(fault: Fault, out: Path, rec: dict, log, share: float = 1.0) -> dict:
    """Baseline (f16 KV) and candidate (quantised KV) llama-servers, the same long-context prompts,
    greedy and teacher-forced; the candidate's capture holds each request's comparison (``kvdoctor
    quality``). Offline by nature: there is no live verdict."""
    from kvdoctor.quality.capture import write_capture
    from kvdoctor.quality.probe import compare

    kv, n_ctx = fault.params["kv"], 4096
    t0 = rec["load_start_s"] = rec["fault_start_s"] = time.time()
    with LlamaServer(["-fa", "on", "-ctk", "f16", "-ctv", "f16"], n_ctx=n_ctx) as base, \
            LlamaServer(["-fa", "on", "-ctk", kv, "-ctv", kv], n_ctx=n_ctx) as cand:
        # 8 prompts (the rule's request floor: fewer could never fire it) of 100 to 1,800 tokens of
        # context, each continued 48 tokens; a quick run cuts the context and the continuation to
        # its share instead (prefill is most of a comparison's time on a CPU)
        quick = share < 1.0
        prompts = quality_prompts(8, 100, max(200, round(1800 * share)) if quick else 1800)
        results = compare(base.url, cand.url, prompts, max(16, round(48 * share)) if quick else 48)
        # while the candidate is up: the capture asks it which engine it is
        write_capture(results, out, cand.url, {"cache_type_k": kv, "cache_type_v": kv, "flash_attn": "on",
                                               "context_len_tokens": n_ctx, "max_running_requests": 1})
    rec["load_end_s"] = time.time()
    rec["slo"], rec["live"], rec["opened"] = {}, None, []
    rec["client"] = {"broken": ["quality"]}  # the fault is the outputs themselves
    rec["requests"] = rec["ok"] = len(results)
    rec["offline"] = [_incident_json(i) for i in diagnose(kvdoctor.load(out)).incidents]
    rec["wall_s"] = round(time.time() - t0, 1)
    return rec
