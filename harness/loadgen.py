"""Streaming OpenAI-chat load generator that records client-side ground truth.

    reqs = conversations(4, turns=8)
    timings = asyncio.run(run_load(url, reqs, concurrency=2))
    print(summarize(timings))

Every timestamp is wall-clock seconds (``time.time()`` scale) taken from a
monotonic clock anchored once, so differences are exact and never go backwards.

Requests with ``chain=True`` belong to a conversation (``session_id``): their
``messages`` are appended to the session's history (earlier prompts plus the
assistant replies actually received), turns run in ``turn`` order, one at a
time. Other requests are independent.

Bounds: each request has a total timeout (``timeout_s``) and a chunk-count cap;
the whole run has ``max_duration_s``; the number of requests is fixed.

CLI::

    python -m harness.loadgen --url http://127.0.0.1:8080 --kind multi-turn --n 4 --concurrency 2
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import orjson

from kvdoctor.numeric import json_number, percentile_sorted
from .workloads import (  # noqa: F401  (re-exported: tests, benchmarks and scenarios use loadgen.NAME)
    ChatRequest, conversations, filler_text, long_prompts, shared_prefix, short_prompts)

# --------------------------------------------------------------------------- timings


@dataclass(frozen=True)
class ClientTiming:
    request_id: str
    session_id: str
    turn: int
    send_s: float                       # wall clock, just before the POST
    first_token_s: float | None         # first chunk carrying generated text
    finish_s: float                     # stream end / error
    ttft_s: float | None
    e2e_s: float
    chunk_times_s: tuple[float, ...]    # wall clock of each text-carrying chunk
    output_tokens: int                  # usage.completion_tokens, else chunk count
    prompt_tokens: int | None           # usage.prompt_tokens if the server sent it
    status: str                         # "ok" | "error"
    http_status: int | None
    error: str | None = None
    cached_tokens: int | None = None    # usage.prompt_tokens_details.cached_tokens, if sent
    server_timings: dict | None = None  # llama.cpp's "timings" object, if sent
    output_chars: int = 0
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["chunk_times_s"] = list(self.chunk_times_s)
        d["tpot_s"] = self.tpot_s
        return d


class _Clock:
    """Wall-clock timestamps from a monotonic clock."""

    def __init__(self) -> None:
        self.wall0, self.mono0 = time.time(), time.perf_counter()

    def now(self) -> float:
        return self.wall0 + (time.perf_counter() - self.mono0)


# --------------------------------------------------------------------------- one request


async def _stream_chat(session: aiohttp.ClientSession, url: str, req: ChatRequest,
                       messages: list[dict], clock: _Clock, timeout_s: float
                       ) -> tuple[ClientTiming, str]:
    completions = req.api == "completions"
    body: dict[str, Any] = {
        "model": req.model,
        **({"prompt": "\n\n".join(str(m.get("content", "")) for m in messages)} if completions
           else {"messages": messages}),
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(req.extra_body)
    max_chunks = 4 * max(1, req.max_tokens) + 64
    chunks: list[float] = []
    text_parts: list[str] = []
    usage: dict | None = None
    timings: dict | None = None
    finish_reason = None
    http_status = None
    error = None
    send = clock.now()
    try:
        timeout_s = req.timeout_s or timeout_s
        path = "/v1/completions" if completions else "/v1/chat/completions"
        async with session.post(url.rstrip("/") + path, json=body,
                                headers={"X-Request-Id": req.request_id, **req.headers},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            http_status = resp.status
            if resp.status != 200:
                error = (await resp.text())[:2000]
            else:
                n_lines = 0
                async for raw in resp.content:  # one SSE line at a time
                    n_lines += 1
                    if n_lines > 4 * max_chunks:
                        error = f"stream exceeded {4 * max_chunks} lines"
                        break
                    line = raw.decode("utf-8", "replace").strip()
                    if not line or line.startswith(":"):
                        continue
                    if line.startswith("error:"):
                        error = line[6:].strip()[:2000]
                        break
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    try:
                        obj = json.loads(payload)
                    except json.JSONDecodeError:
                        continue
                    if "error" in obj:
                        error = json.dumps(obj["error"])[:2000]
                        break
                    t = clock.now()
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if obj.get("timings"):
                        timings = obj["timings"]
                    for ch in obj.get("choices") or ():
                        delta = ch.get("delta") or {}
                        piece = ch.get("text") if completions else (delta.get("content") or delta.get("reasoning_content"))
                        if piece:
                            text_parts.append(piece)
                            chunks.append(t)
                        if ch.get("finish_reason"):
                            finish_reason = ch["finish_reason"]
                    if len(chunks) > max_chunks:
                        error = f"more than {max_chunks} chunks for max_tokens={req.max_tokens}"
                        break
    except asyncio.TimeoutError:
        # a request's own deadline is the client giving up (and disconnecting), not a server timeout
        error = f"client gave up after {timeout_s}s" if req.timeout_s else f"timeout after {timeout_s}s"
    except aiohttp.ClientError as e:
        error = f"{type(e).__name__}: {e}"
    finish = clock.now()
    first = chunks[0] if chunks else None
    out_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else len(chunks)
    cached = None
    if usage and isinstance(usage.get("prompt_tokens_details"), dict):
        cached = usage["prompt_tokens_details"].get("cached_tokens")
    if cached is None and timings and "cache_n" in timings:
        cached = timings["cache_n"]
    text = "".join(text_parts)
    ok = error is None and http_status == 200
    return ClientTiming(
        request_id=req.request_id, session_id=req.session_id, turn=req.turn,
        send_s=send, first_token_s=first, finish_s=finish,
        ttft_s=(first - send) if first is not None else None, e2e_s=finish - send,
        chunk_times_s=tuple(chunks), output_tokens=out_tokens,
        prompt_tokens=int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else None,
        status="ok" if ok else "error", http_status=http_status,
        error=None if ok else (error or f"HTTP {http_status}"),
        cached_tokens=cached, server_timings=timings, output_chars=len(text),
        finish_reason=finish_reason,
    ), text


def _skipped(req: ChatRequest, clock: _Clock, why: str) -> ClientTiming:
    t = clock.now()
    return ClientTiming(req.request_id, req.session_id, req.turn, t, None, t, None, 0.0, (), 0,
                        None, "error", None, why)


# --------------------------------------------------------------------------- runner


async def run_load(url: str, requests: Sequence[ChatRequest], concurrency: int,
                   arrival_rate_per_s: float | None = None, timeout_s: float = 120,
                   max_duration_s: float | None = None, seed: int = 0) -> list[ClientTiming]:
    """Send ``requests``; at most ``concurrency`` in flight.

    Units are independent requests and whole conversations (chained requests of one
    session). With ``arrival_rate_per_s`` units start at Poisson arrival times
    (open loop); without it they all start at once, gated by ``concurrency``.
    Returns one :class:`ClientTiming` per request, in input order.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    clock = _Clock()
    sem = asyncio.Semaphore(concurrency)
    results: dict[int, ClientTiming] = {}
    units: list[list[tuple[int, ChatRequest]]] = []
    by_session: dict[str, list[tuple[int, ChatRequest]]] = {}
    for i, r in enumerate(requests):
        if r.chain:
            if r.session_id not in by_session:
                by_session[r.session_id] = []
                units.append(by_session[r.session_id])
            by_session[r.session_id].append((i, r))
        else:
            units.append([(i, r)])
    for u in units:
        u.sort(key=lambda ir: ir[1].turn)
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in units:
        offsets.append(t)
        if arrival_rate_per_s:
            t += rng.expovariate(arrival_rate_per_s)
    if max_duration_s is None:
        longest = max((len(u) for u in units), default=1)
        max_duration_s = t + timeout_s * longest * max(1, -(-len(units) // concurrency)) + 10

    # force_close: llama-server may drop a keep-alive connection after a stream, and a
    # reused dead socket fails with "Can not write request body"; loopback connects are cheap.
    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def run_unit(unit: list[tuple[int, ChatRequest]], start_offset: float) -> None:
            await asyncio.sleep(start_offset)
            history: list[dict] = []
            failed = False
            for idx, req in unit:
                if failed:
                    results[idx] = _skipped(req, clock, "skipped: an earlier turn failed")
                    continue
                if req.think_s > 0 and history:
                    await asyncio.sleep(req.think_s)
                msgs = history + list(req.messages) if req.chain else list(req.messages)
                async with sem:
                    timing, text = await _stream_chat(session, url, req, msgs, clock, timeout_s)
                results[idx] = timing
                if timing.status != "ok":
                    failed = req.chain
                elif req.chain:
                    history = msgs + [{"role": "assistant", "content": text}]

        tasks = [asyncio.create_task(run_unit(u, off)) for u, off in zip(units, offsets)]
        done, pending = await asyncio.wait(tasks, timeout=max_duration_s)
        for tk in pending:
            tk.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for tk in done:
            if tk.exception() is not None:
                raise tk.exception()  # a bug, not a server error
    return [results.get(i) or _skipped(r, clock, f"cancelled: run exceeded {max_duration_s:.0f}s")
            for i, r in enumerate(requests)]


# --------------------------------------------------------------------------- summary


def write_timings(path: Path, timings: Sequence[ClientTiming]) -> None:
    """The client's own timings as JSON lines (``client-timings.jsonl`` beside a capture: the
    ground truth the tests pair the capture with), without the per-chunk arrival times."""
    with open(path, "wb") as f:
        for x in timings:
            d = x.to_dict()
            d.pop("chunk_times_s", None)
            f.write(orjson.dumps(d) + b"\n")


def summarize(timings: Sequence[ClientTiming]) -> dict[str, Any]:
    ok = [t for t in timings if t.status == "ok"]
    ttft = sorted(t.ttft_s for t in ok if t.ttft_s is not None)
    tpot = sorted(t.tpot_s for t in ok if t.tpot_s is not None)
    e2e = sorted(t.e2e_s for t in ok)
    span = (max(t.finish_s for t in timings) - min(t.send_s for t in timings)) if timings else 0.0
    out_tok = sum(t.output_tokens for t in ok)

    def r(x: float | None) -> float | None:
        return json_number(x, 4)

    return {
        "n": len(timings), "ok": len(ok), "errors": len(timings) - len(ok),
        "ttft_p50_s": r(percentile_sorted(ttft, 50)), "ttft_p99_s": r(percentile_sorted(ttft, 99)),
        "tpot_p50_s": r(percentile_sorted(tpot, 50)), "tpot_p99_s": r(percentile_sorted(tpot, 99)),
        "e2e_p50_s": r(percentile_sorted(e2e, 50)), "e2e_p99_s": r(percentile_sorted(e2e, 99)),
        "output_tokens": out_tok, "duration_s": r(span),
        "output_tokens_per_s": r(out_tok / span) if span > 0 else None,
        "error_samples": sorted({(t.error or "")[:200] for t in timings if t.status != "ok"})[:5],
    }


# --------------------------------------------------------------------------- CLI


def _build(kind: str, n: int, args: argparse.Namespace) -> list[ChatRequest]:
    if kind == "short":
        return short_prompts(n, max_tokens=args.max_tokens)
    if kind == "long":
        return long_prompts(n, args.prompt_tokens, max_tokens=args.max_tokens)
    if kind == "multi-turn":
        return conversations(n, args.turns, max_tokens=args.max_tokens)
    if kind == "shared-prefix":
        return shared_prefix(n, args.prompt_tokens, cache_prompt=not args.no_cache_prompt,
                             max_tokens=args.max_tokens)
    raise ValueError(kind)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.loadgen",
                                 description="Streaming OpenAI-chat load generator; prints a JSON summary.")
    ap.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8080")
    ap.add_argument("--kind", choices=["short", "long", "multi-turn", "shared-prefix"], default="short")
    ap.add_argument("--n", type=int, default=8, help="requests (or conversations for multi-turn)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (open loop)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=1000, help="for long / shared-prefix")
    ap.add_argument("--turns", type=int, default=4, help="for multi-turn")
    ap.add_argument("--no-cache-prompt", action="store_true", help="shared-prefix: cache_prompt=false")
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--per-request", action="store_true", help="also print every ClientTiming")
    args = ap.parse_args(argv)
    reqs = _build(args.kind, args.n, args)
    timings = asyncio.run(run_load(args.url, reqs, args.concurrency, args.rate, timeout_s=args.timeout))
    out: dict[str, Any] = {"kind": args.kind, **summarize(timings)}
    if args.per_request:
        out["requests"] = [t.to_dict() for t in timings]
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if out["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
