"""Real-server scenarios: a real llama-server, kvdoctor attached in proxy + scrape mode, a
real streaming load through the proxy. Each writes a capture plus the client's own timings
(``client-timings.jsonl``, the ground truth) and names the rule it should make the top cause.

    python -m harness.scenarios multi-turn -o samples/multi-turn
    python -m harness.scenarios multi-turn -o samples/vllm-multi-turn --engine vllm

On vLLM (``--engine vllm``, :mod:`harness.vllm_server`) a scenario's llama.cpp context
``n_ctx`` shared by ``parallel`` slots becomes ``--max-model-len n_ctx/parallel --max-num-seqs parallel``;
``Scenario.vllm`` overrides or adds VllmServer arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from kvdoctor.sidecar.agent import Agent, AttachConfig
from kvdoctor.collect.host import HostCollector
from kvdoctor.collect.scrape import ScrapeCollector
from kvdoctor.diagnosis import Options, load_rules
from . import loadgen
from .server_base import wait_listening
from .llama_server import LlamaServer, free_port


@dataclass(frozen=True)
class Phase:
    requests: Callable[[], list[loadgen.ChatRequest]]
    concurrency: int
    arrival_rate_per_s: float | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    doc: str
    phases: tuple[Phase, ...]
    expect: str | None  # rule that must be the top cause of an incident (None: no incident)
    n_ctx: int = 4096
    parallel: int = 2
    server_args: tuple[str, ...] = ()
    engine_config: dict = field(default_factory=dict)
    vllm: dict = field(default_factory=dict)  # VllmServer keyword arguments (--engine vllm)
    cpu_hogs: int = 0  # busy-loop processes beside the server for the whole load (a contended host)
    vllm_phases: tuple[Phase, ...] | None = None  # the load on vLLM, where it differs (--engine vllm)

    def phases_for(self, engine: str) -> tuple[Phase, ...]:
        return self.vllm_phases if engine == "vllm" and self.vllm_phases else self.phases


def _mix(short: list, long_: list, every: int) -> list:
    out, li = [], iter(long_)
    for i, r in enumerate(short):
        out.append(r)
        if i % every == every - 1:
            out.append(next(li, None))
    return [r for r in out + list(li) if r is not None]


def _long_range(n: int, shortest: int, longest: int, max_tokens: int) -> list[loadgen.ChatRequest]:
    """``n`` distinct long prompts whose lengths spread evenly from ``shortest`` to ``longest`` tokens."""
    sizes = np.linspace(shortest, longest, n).astype(int)
    return [loadgen.long_prompts(1, tokens=int(t), max_tokens=max_tokens, seed=100 + i)[0] for i, t in enumerate(sizes)]


def _fixed(reqs: list[loadgen.ChatRequest]) -> list[loadgen.ChatRequest]:
    """Generate exactly max_tokens (llama.cpp's ignore_eos): output length is then a setting,
    not a property of the text, so latency differences are the server's."""
    for r in reqs:
        r.extra_body.setdefault("ignore_eos", True)
    return reqs


#: vLLM settings shared by several scenarios, so tests start one server for all of them
VLLM_MAIN = {"max_model_len": 2048, "max_num_seqs": 4}
#: 9 blocks of 128 tokens (one reserved): 1,024 tokens of KV; 512-token sequences at most
VLLM_TINY_KV = {"max_model_len": 512, "max_num_seqs": 8, "num_gpu_blocks_override": 9}

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("healthy", "modest load, short prompts: no incident",
             (Phase(lambda: _fixed(loadgen.short_prompts(40, max_tokens=24)), concurrency=2, arrival_rate_per_s=1.5),),
             expect=None, n_ctx=4096, parallel=2),
    Scenario("long-prompts", "short prompts mixed with very long ones: prefill-bound, short requests behind long prefills",
             (Phase(lambda: _fixed(_mix(loadgen.short_prompts(36, max_tokens=16),
                                        loadgen.long_prompts(9, tokens=1800, max_tokens=16), every=4)),
                    concurrency=2, arrival_rate_per_s=0.8),),
             expect="prefill-bound", n_ctx=8192, parallel=2),
    Scenario("multi-turn", "conversations of 10 turns with growing history: kv-growth-per-turn",
             (Phase(lambda: _fixed(loadgen.conversations(6, 10, max_tokens=48, user_tokens=80)), concurrency=3),),
             expect="kv-growth-per-turn", n_ctx=3 * 4096, parallel=3, vllm=VLLM_MAIN,
             # vLLM's prefix cache prefills only each turn's new tokens, and a 135M model's decode
             # step is mostly its weights: ~150 tokens a turn grew decode ~2.6%/turn, near the
             # rule's 2% on a fresh run. ~230 a turn for 8 turns reads ~1.5x more KV per turn
             # within the server's 2,048-token limit (turn 8: ~1,850 prompt tokens)
             vllm_phases=(Phase(lambda: _fixed(loadgen.conversations(6, 8, max_tokens=48, user_tokens=160)),
                                concurrency=3),)),
    Scenario("concurrency", "single streams, then 8 concurrent decodes on 8 slots: decode slows with batch size",
             # long enough (~45 s on an idle 2-core machine) for the rules' 30 s hold time
             (Phase(lambda: _fixed(loadgen.short_prompts(20, max_tokens=64)), concurrency=1),
              Phase(lambda: _fixed(loadgen.short_prompts(96, max_tokens=64, seed=5)), concurrency=8)),
             # on 2 CPU threads decode is compute-bound (tests/labels.yaml), within the TPOT objective:
             # no incident; decode-bandwidth-bound may say its CPU hypothesis as an observation
             expect=None, n_ctx=8 * 1024, parallel=8),
    Scenario("context-overflow", "small context, long requests at concurrency: rejected for lack of KV space",
             (Phase(lambda: _fixed(_mix(loadgen.long_prompts(20, tokens=250, max_tokens=32),
                                        loadgen.long_prompts(20, tokens=700, max_tokens=32, seed=3), every=1)),
                    concurrency=4),),
             expect="error-burst", n_ctx=2048, parallel=4, vllm=VLLM_TINY_KV),
    Scenario("healthy-again", "the healthy scenario run a second time: compare must find no significant change",
             (Phase(lambda: _fixed(loadgen.short_prompts(40, max_tokens=24)), concurrency=2, arrival_rate_per_s=1.5),),
             expect=None, n_ctx=4096, parallel=2),
    Scenario("busy-host", "the healthy load (60 requests) while two other processes spin on the host's cores: "
             "decode steps stall for a core; kvdoctor must blame the host, not the workload",
             (Phase(lambda: _fixed(loadgen.short_prompts(60, max_tokens=24, seed=11)), concurrency=2, arrival_rate_per_s=1.5),),
             expect="decode-stall-tail", n_ctx=4096, parallel=2, cpu_hogs=2),
    Scenario("parallel-8", "the same open-loop load on 8 slots: decodes share the CPU, TPOT high, little queueing",
             (Phase(lambda: _fixed(loadgen.short_prompts(48, max_tokens=48, seed=9)), concurrency=16, arrival_rate_per_s=4.0),),
             expect=None, n_ctx=8 * 1024, parallel=8),  # a compare pair: too short for the rules' hold times
    Scenario("parallel-2", "the same open-loop load on 2 slots: TPOT lower, requests queue for a slot",
             (Phase(lambda: _fixed(loadgen.short_prompts(48, max_tokens=48, seed=9)), concurrency=16, arrival_rate_per_s=4.0),),
             expect=None, n_ctx=2 * 1024, parallel=2),
    # issue 12, class 9: shapes seen on a real llama-server that were named wrongly
    Scenario("one-conversation-at-a-time", "two conversations of 12 turns (~160 words each), one after the other: "
             "concurrency 1, only the history grows: kv-growth-per-turn, not decode-bandwidth-bound",
             (Phase(lambda: _fixed(loadgen.conversations(2, 12, max_tokens=24, user_tokens=160, seed=12)), concurrency=1),),
             expect="kv-growth-per-turn", n_ctx=2 * 4096, parallel=2),
    Scenario("mixed-prompts-2-slots", "three clients sending 10-word and 900-1,400-word prompts to 2 slots: the long "
             "prefills hold the slots, short requests wait behind them",
             (Phase(lambda: _fixed(_mix(loadgen.short_prompts(30, max_tokens=16, seed=12),
                                        _long_range(10, 900, 1400, max_tokens=16), every=3)), concurrency=3),),
             expect="prefill-bound", n_ctx=2 * 4096, parallel=2),
    # issue 17: long prompts arriving while other requests decode; llama.cpp puts a new prompt's
    # tokens (up to -b per step) into the same step as the running decodes, so their ITL spikes
    Scenario("prefill-interference", "long decodes (short prompts, 160 tokens out) while 1,500-token prompts "
             "arrive: each long prefill shares the decode steps, ITL spikes by its prefill time",
             (Phase(lambda: _fixed(_mix(loadgen.short_prompts(30, max_tokens=160, seed=17),
                                        loadgen.long_prompts(15, tokens=1500, max_tokens=8, seed=17), every=2)),
                    concurrency=4, arrival_rate_per_s=0.8),),
             expect="prefill-decode-interference", n_ctx=4 * 2048, parallel=4),
    Scenario("prefill-interference-small-batch", "the same load with -b 128 -ub 128: a long prompt is "
             "prefilled 128 tokens per step between decode steps, so each stall is shorter",
             (Phase(lambda: _fixed(_mix(loadgen.short_prompts(30, max_tokens=160, seed=17),
                                        loadgen.long_prompts(15, tokens=1500, max_tokens=8, seed=17), every=2)),
                    concurrency=4, arrival_rate_per_s=0.8),),
             expect="prefill-decode-interference", n_ctx=4 * 2048, parallel=4, server_args=("-b", "128", "-ub", "128")),
    Scenario("prefix-cache-on", "a long shared system prompt, prompt caching on: the cache serves it",
             (Phase(lambda: _fixed(loadgen.shared_prefix(24, 1200, cache_prompt=True)), concurrency=1),),
             expect=None, n_ctx=4096, parallel=1, vllm=VLLM_MAIN),
    Scenario("prefix-cache-off", "the same requests with cache_prompt false: prefix-cache-ineffective",
             (Phase(lambda: _fixed(loadgen.shared_prefix(24, 1200, cache_prompt=False)), concurrency=1),),
             expect="prefix-cache-ineffective", n_ctx=4096, parallel=1, vllm={**VLLM_MAIN, "prefix_caching": False}),
)}


# issue 31: harm, not shapes. A healthy server with mixed prompt sizes (TTFT grows with prompt
# length, as it always does) must page nobody; a ramp from one user to twelve on four slots must
# page from where the queue formed (the second phase), not from the capture's first second
SCENARIOS.update({s.name: s for s in (
    Scenario("healthy-mixed", "two light users with think time, prompts of 10-440 tokens: TTFT grows with the "
             "prompt, nobody waits: no incident (prefill-bound at most an observation)",
             (Phase(lambda: _fixed(_mix(loadgen.short_prompts(24, max_tokens=24, seed=31),
                                        _long_range(12, 100, 440, max_tokens=24), every=2)),
                    concurrency=2, arrival_rate_per_s=0.8),),
             expect=None, n_ctx=4096, parallel=2, vllm=VLLM_MAIN),
    Scenario("ramp", "one user for ~40 s, then twelve at once on four slots: the queue forms at the second phase",
             (Phase(lambda: _fixed(loadgen.short_prompts(20, max_tokens=32, seed=32)), concurrency=1,
                    arrival_rate_per_s=0.5),
              Phase(lambda: _fixed(loadgen.short_prompts(84, max_tokens=48, seed=33)), concurrency=12)),
             expect="queueing-saturation", n_ctx=4 * 2048, parallel=4, vllm=VLLM_MAIN),
)})


# scenarios written for vLLM's paged KV cache and scheduler (they run on llama.cpp too)
SCENARIOS.update({s.name: s for s in (
    Scenario("preemption", "long concurrent requests on a tiny paged KV cache: the scheduler preempts",
             (Phase(lambda: _fixed(loadgen.long_prompts(12, tokens=160, max_tokens=256, seed=7)), concurrency=8),),
             expect="kv-pressure-preemption", n_ctx=8 * 1024, parallel=8, vllm=VLLM_TINY_KV),
    Scenario("saturation", "open-loop arrivals above what 4 slots serve: every request waits in the queue",
             (Phase(lambda: _fixed(loadgen.short_prompts(110, max_tokens=48, seed=11)), concurrency=64,
                    arrival_rate_per_s=4.0),),
             expect="queueing-saturation", n_ctx=4 * 2048, parallel=4, vllm=VLLM_MAIN),
)})


def vllm_options(scenario: Scenario) -> dict:
    """VllmServer keyword arguments for a scenario (its llama.cpp sizing, then its overrides)."""
    return {"max_model_len": scenario.n_ctx // scenario.parallel, "max_num_seqs": scenario.parallel, **scenario.vllm}


def make_server(scenario: Scenario, engine: str = "llamacpp", **over):
    """The (unstarted) server a scenario runs on; a context manager."""
    if engine == "vllm":
        from .vllm_server import VllmServer

        return VllmServer(**{**vllm_options(scenario), **over})
    if engine != "llamacpp":
        raise ValueError(f"engine must be 'llamacpp' or 'vllm', not {engine!r}")
    return LlamaServer(list(scenario.server_args), n_ctx=scenario.n_ctx, parallel=scenario.parallel, **over)


def engine_config(scenario: Scenario, engine: str) -> dict:
    """What kvdoctor is told besides what it reads from the server (``attach --engine-config``):
    vLLM publishes no --max-num-seqs, so the scenario says it."""
    cfg = dict(scenario.engine_config)
    if engine == "vllm":
        cfg.setdefault("max_running_requests", vllm_options(scenario)["max_num_seqs"])
    return cfg


class AttachedAgent:
    """kvdoctor attached to a server, running in a thread of its own (as a sidecar would)."""

    def __init__(self, server_url: str, capture: Path, server_pid: int | None, engine_config: dict | None = None,
                 step_s: float = 5.0, scrape: bool = True, slo: dict | None = None, **attach):
        """``attach``: more AttachConfig fields, e.g. ``otlp_grpc_receiver="127.0.0.1:4317"``. ``scrape=False``:
        proxy only (``--no-scrape``), e.g. in front of a router whose /metrics would mix several servers.
        ``slo``: stated objectives (``--slo``), e.g. ``{"tpot_p99_s": 0.25}``."""
        self.proxy_port = free_port()
        cfg = AttachConfig(server_url=server_url, capture_dir=capture, listen=None, proxy=f"127.0.0.1:{self.proxy_port}",
                           rules=load_rules(), options=Options(lookback_s=300, step_s=step_s, slo=dict(slo or {})),
                           engine_config=dict(engine_config or {}),
                           collectors=[ScrapeCollector(server_url, interval_s=1.0, parse_in_process=True)] * scrape + [HostCollector(pid=server_pid)],
                           **attach)
        self.agent = Agent(cfg)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.agent.run(),), daemon=True)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def __enter__(self) -> "AttachedAgent":
        self.thread.start()
        wait_listening(self.proxy_port)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.agent.stop)
        self.thread.join(60)


@contextlib.contextmanager
def hogs(n: int):
    """``n`` processes that spin on a core each: other work on the server's host."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run(scenario: Scenario, out: Path, *, log=print, engine: str = "llamacpp", server=None,
        on_attach=None) -> list[loadgen.ClientTiming]:
    """Run one scenario; the capture lands in ``out`` with client-timings.jsonl beside it. ``server``:
    a running server started with the scenario's settings (tests share one across scenarios).
    ``on_attach(agent)``: called once the sidecar runs, before the load (tests watch it live)."""
    if out.exists():
        shutil.rmtree(out)
    timings: list[loadgen.ClientTiming] = []
    with contextlib.nullcontext(server) if server is not None else make_server(scenario, engine) as srv:
        with AttachedAgent(srv.url, out, srv.pid, engine_config(scenario, engine)) as att, hogs(scenario.cpu_hogs):
            if on_attach is not None:
                on_attach(att.agent)
            for i, phase in enumerate(scenario.phases_for(engine)):
                t = time.monotonic()
                got = asyncio.run(loadgen.run_load(att.proxy_url, phase.requests(), phase.concurrency,
                                                   phase.arrival_rate_per_s, timeout_s=300, max_duration_s=600))
                timings += got
                ok = sum(1 for x in got if x.status == "ok")
                log(f"{scenario.name}: phase {i + 1}: {ok}/{len(got)} ok in {time.monotonic() - t:.0f} s")
            time.sleep(1.5)  # one more scrape after the last request
    loadgen.write_timings(out / "client-timings.jsonl", timings)
    return timings


#: KV formats for the quality scenarios: candidate (-ctk/-ctv) against an f16 baseline
KV_QUANT = {"kv-quant": "q4_0", "kv-quant-q8": "q8_0"}


def quality_prompts(n: int = 8, shortest: int = 100, longest: int = 1800) -> list[list[dict[str, str]]]:
    """Long-context prompts: a document of growing length, then a question about its start."""
    out = []
    for i, tokens in enumerate(np.linspace(shortest, longest, n).astype(int)):
        doc = loadgen.filler_text(int(tokens), seed=1000 + i)
        out.append([{"role": "user", "content": f"Here is a document.\n\n{doc}\n\nList the first ten words of the document, then explain what it is about."}])
    return out


def run_quality(name: str, out: Path, *, max_tokens: int = 48, log=print):
    """Baseline (f16 KV) and candidate (quantised KV) servers, same prompts, greedy; writes the
    candidate's capture with each request's baseline comparison (see `kvdoctor quality`)."""
    from kvdoctor.quality import by_context, compare, verdict, write_capture

    kv = KV_QUANT[name]
    if out.exists():
        shutil.rmtree(out)
    n_ctx = 4096
    base_args = ["-fa", "on", "-ctk", "f16", "-ctv", "f16"]
    cand_args = ["-fa", "on", "-ctk", kv, "-ctv", kv]
    with LlamaServer(base_args, n_ctx=n_ctx) as base, LlamaServer(cand_args, n_ctx=n_ctx) as cand:
        results = compare(base.url, cand.url, quality_prompts(), max_tokens)
        # while the candidate is up: the capture asks it which engine it is
        write_capture(results, out, cand.url, {"cache_type_k": kv, "cache_type_v": kv, "flash_attn": "on",
                                               "context_len_tokens": n_ctx, "max_running_requests": 1})
    log(f"{name}: {verdict(by_context(results), results=results)}")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(SCENARIOS) + sorted(KV_QUANT) + ["all"])
    ap.add_argument("-o", "--out", type=Path, help="capture folder (default: samples/NAME)")
    ap.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp", help="the real server to run on")
    args = ap.parse_args(argv)
    names = sorted(SCENARIOS) + sorted(KV_QUANT) if args.name == "all" else [args.name]
    if args.engine == "vllm":
        names = [n for n in names if n not in KV_QUANT]  # llama.cpp KV formats (-ctk/-ctv)
    for name in names:
        prefix = "vllm-" if args.engine == "vllm" else ""
        out = args.out if args.out and len(names) == 1 else Path("samples") / (prefix + name)
        if name in KV_QUANT:
            run_quality(name, out)
        else:
            run(SCENARIOS[name], out, engine=args.engine)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
