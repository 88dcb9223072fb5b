"""The fault zoo: each run injects one known fault (or none: a control) into a real server, so its
label is the fault's construction, never kvdoctor's output.

A :class:`Fault` is one *setting* of a fault *class*: the server's flags, the load (prompt mix,
concurrency, arrival rate, API) and the injection. Every class has at least three settings that
differ in load, prompt mix and engine flags, so no single threshold passes a class; one setting
of each class (``quick=True``) makes the quick run: the shortest in the full run on this machine,
chosen by wall time whatever it scored (kv-quant's q4_0 stays, though q4_1 is 6 s shorter and
scored right where q4_0 did not, so the quick run is not the benchmark's best face), sent at
:data:`QUICK_SHARE` of its requests (:func:`cut`), a crash injected at that share of its time, a
quality run's 8 prompts kept (the rule's request floor), their context and continuation cut to
that share. The quick run proves the whole path runs and
scores on both engines inside the test suite's time; its scores are not the benchmark's figures
(a shorter load can end before a rule's hold), the full run's are. ``expect`` lists the causes that
name the injected fault (a rule, and where the rule names several causes, words of the cause
title); a run whose leading cause is one of them is right. ``expect=()``: nothing at the server
is at fault (controls, clients that disconnect), so nothing may page (info observations may).

The settings deliberately differ from the scenarios the rules were written on (harness/scenarios.py,
samples/): other loads, prompt mixes, batch sizes, both the chat and the completions API.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from harness import loadgen
from harness.workloads import ChatRequest

LLAMACPP, VLLM = "llamacpp", "vllm"
BOTH = (LLAMACPP, VLLM)

#: the share of each load's requests the quick run sends: the 26 quick runs took 28 min whole,
#: 12 min at 40% (issue 34 asks <= 15 min for the quick run, and the suite <= 45 min)
QUICK_SHARE = 0.3
#: the fewest requests a cut load keeps (a rule needs ~10 requests in a window to judge them)
QUICK_MIN_REQUESTS = 10

#: vLLM servers the runs share (a start costs ~1-2 min here): the main one chunks prefills at
#: 512 tokens (an engine flag the scenarios do not use); the small one has 10 KV blocks of 128
#: tokens (1,152 usable) for sequences of at most 512 tokens
VLLM_SERVERS = {
    "main": {"max_model_len": 2048, "max_num_seqs": 4, "extra_args": ("--max-num-batched-tokens", "512")},
    "small-kv": {"max_model_len": 512, "max_num_seqs": 8, "num_gpu_blocks_override": 10},
}


@dataclass(frozen=True)
class Cause:
    """A cause that names the injected fault: ``rule``, and ``says`` (words of its cause title)
    where the rule tells several causes apart (error-burst: rate limit, context, crash, ...)."""
    rule: str
    says: str = ""

    def matches(self, rule: str, title: str) -> bool:
        return rule == self.rule and self.says.lower() in (title or "").lower()

    def __str__(self) -> str:
        return f"{self.rule} ({self.says})" if self.says else self.rule


@dataclass(frozen=True)
class Load:
    """One phase of the load; ``fault``: the fault is present from this phase's start."""
    requests: Callable[[], list[ChatRequest]]
    concurrency: int
    rate_per_s: float | None = None
    fault: bool = True


@dataclass(frozen=True)
class Fault:
    cls: str
    setting: str
    what: str
    expect: tuple[Cause, ...]
    loads: tuple[Load, ...] = ()
    engines: tuple[str, ...] = BOTH
    kind: str = "load"  # load | gateway | routing | crash | quality | leak
    llama: dict = field(default_factory=lambda: {"n_ctx": 4096, "parallel": 2})
    vllm: str = "main"  # which shared vLLM server (VLLM_SERVERS)
    hogs: int = 0       # processes spinning on a core each beside the server, for the whole load
    quick: bool = False
    #: the engines the quick run takes this setting on (None: all of ``engines``)
    quick_engines: tuple[str, ...] | None = None
    params: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.cls}/{self.setting}"

    @property
    def control(self) -> bool:
        return not self.expect


# --------------------------------------------------------------------------- workloads


def _short(n: int, max_tokens: int, seed: int, api: str = "chat", **kw) -> Callable[[], list[ChatRequest]]:
    def make():
        out = loadgen.short_prompts(n, max_tokens=max_tokens, seed=seed)
        for r in out:
            r.api = api
            r.extra_body["ignore_eos"] = True  # output length is a setting, not a property of the text
            for k, v in kw.items():
                setattr(r, k, v)
        return out
    return make


def _mixed(n_short: int, n_long: int, long_tokens: tuple[int, int], max_tokens: int, seed: int,
           long_max_tokens: int | None = None, api: str = "chat") -> Callable[[], list[ChatRequest]]:
    """Short prompts with long ones (lengths spread over ``long_tokens``) placed at random."""
    def make():
        rng = random.Random(seed)
        short = loadgen.short_prompts(n_short, max_tokens=max_tokens, seed=seed)
        sizes = np.linspace(*long_tokens, n_long).astype(int)
        long_ = [loadgen.long_prompts(1, tokens=int(t), max_tokens=long_max_tokens or max_tokens, seed=seed * 1000 + i)[0]
                 for i, t in enumerate(sizes)]
        out = short + long_
        rng.shuffle(out)
        for r in out:
            r.api = api
            r.extra_body["ignore_eos"] = True
        return out
    return make


def _conversations(n: int, turns: int, user_tokens: int, max_tokens: int, seed: int) -> Callable[[], list[ChatRequest]]:
    def make():
        out = loadgen.conversations(n, turns, max_tokens=max_tokens, user_tokens=user_tokens, seed=seed)
        for r in out:
            r.extra_body["ignore_eos"] = True
        return out
    return make


def _shared_prefix(n: int, prefix_tokens: int, seed: int, salted: bool) -> Callable[[], list[ChatRequest]]:
    """``n`` questions behind one long system prompt; ``salted``: the cache cannot serve the
    prefix (llama.cpp ``cache_prompt: false``; vLLM a different ``cache_salt`` per request)."""
    def make():
        out = loadgen.shared_prefix(n, prefix_tokens, cache_prompt=not salted, max_tokens=12, seed=seed)
        for i, r in enumerate(out):
            r.extra_body["ignore_eos"] = True
            if salted:
                r.extra_body["cache_salt"] = f"user-{seed}-{i}"
        return out
    return make


def _tenants(n: int, tenants: int, prefix_tokens: int, seed: int) -> Callable[[], list[ChatRequest]]:
    """Requests of ``tenants`` tenants in random order, each tenant's behind its own long system
    prompt (cache_prompt on); the tenant travels in an ``X-Tenant`` header a router can hash."""
    def make():
        rng = random.Random(seed)
        out = []
        for i in range(n):
            t = rng.randrange(tenants)
            r = loadgen.shared_prefix(1, prefix_tokens, cache_prompt=True, max_tokens=12, seed=seed * 10 + t)[0]
            r.messages[-1]["content"] = f"Question {i}: {loadgen.filler_text(20, seed=seed * 977 + i)}?"
            r.headers["X-Tenant"] = f"tenant-{t}"
            r.session_id = f"tenant-{t}-{i}"
            r.extra_body["ignore_eos"] = True
            out.append(r)
        return out
    return make


def _replica(slots: int) -> dict:
    """A routing replica: ``slots`` slots of 2,048 tokens, one thread, no host-RAM prompt cache."""
    return {"n_ctx": slots * 2048, "parallel": slots, "threads": 1, "extra_args": ("--cache-ram", "0")}


def _disconnecting(n: int, max_tokens: int, give_up_s: float, seed: int) -> Callable[[], list[ChatRequest]]:
    """Every other client gives up after ``give_up_s`` and disconnects mid-stream."""
    def make():
        out = loadgen.short_prompts(n, max_tokens=max_tokens, seed=seed)
        for i, r in enumerate(out):
            r.extra_body["ignore_eos"] = True
            if i % 2 == 0:
                r.timeout_s = give_up_s
        return out
    return make


# --------------------------------------------------------------------------- the zoo

Q = (Cause("queueing-saturation"),)
HOL = (Cause("long-prompt-hol-blocking"), Cause("prefill-bound"))
INTERFERENCE = (Cause("prefill-decode-interference"), Cause("decode-stall-tail"))
PREFIX_OFF = (Cause("prefix-cache-ineffective"), Cause("prefix-cache-hit-miss"))
ROUTING = (Cause("prefix-cache-hit-miss"), Cause("prefix-cache-ineffective"))
GROWTH = (Cause("kv-growth-per-turn"),)
HOST = (Cause("host-cpu-contention"), Cause("decode-stall-tail", "host"), Cause("decode-stall-tail", "other processes"),
        Cause("decode-stall-tail", "cpu"))
PREEMPT = (Cause("kv-pressure-preemption"),)
# prompts over the context are refused; prompt + max_tokens over it is cut at the limit (both engines)
OVERFLOW = (Cause("error-burst", "longer than the context"), Cause("output-cut-at-context"))
CRASH = (Cause("error-burst", "went down"), Cause("error-burst", "failing inside the server"))
RATE = (Cause("error-burst", "rate-limited"),)
QUANT = (Cause("kv-quant-quality"),)
LEAK = (Cause("gpu-memory-leak"),)

FAULTS: tuple[Fault, ...] = (
    # ---- queueing under a load ramp: offered load above what the slots serve
    Fault("queueing", "ramp-1-to-10", "one user for ~25 s, then ten at once", Q,
          loads=(Load(_short(12, 24, seed=41), 1, 0.5, fault=False), Load(_short(70, 40, seed=42), 10)),
          llama={"n_ctx": 3 * 1024, "parallel": 3}),
    Fault("queueing", "open-loop-5-per-s", "Poisson arrivals at 5/s, completions API", Q, quick=True,
          loads=(Load(_short(100, 40, seed=43, api="completions"), 64, 5.0),), llama={"n_ctx": 4 * 1024, "parallel": 4}),
    Fault("queueing", "burst-of-60", "60 requests at once on two slots", Q,
          loads=(Load(_short(60, 48, seed=44), 60),), llama={"n_ctx": 2 * 1024, "parallel": 2}),
    # ---- long prompts holding the slots: short requests wait behind long prefills
    Fault("hol-blocking", "1-in-3-long", "a third of the prompts 1,000-1,600 tokens, 3 clients on 2 slots", HOL,
          loads=(Load(_mixed(30, 14, (1000, 1600), 12, seed=51), 3),), llama={"n_ctx": 2 * 2048, "parallel": 2}),
    Fault("hol-blocking", "1-in-5-open-loop", "a fifth 1,200-1,800 tokens, Poisson 1.2/s on 3 slots", HOL,
          loads=(Load(_mixed(40, 10, (1200, 1800), 12, seed=52), 8, 1.2),), llama={"n_ctx": 3 * 2048, "parallel": 3}),
    Fault("hol-blocking", "completions-1-in-2", "half the prompts 600-1,000 tokens, completions API, 4 clients", HOL, quick=True,
          loads=(Load(_mixed(24, 24, (600, 1000), 12, seed=53, api="completions"), 4),), llama={"n_ctx": 2 * 2048, "parallel": 2}),
    # ---- long prefills entering the running decodes' steps
    Fault("interference", "long-decodes-1200", "decodes of 120 tokens while 1,200-token prompts arrive", INTERFERENCE,
          quick=True, loads=(Load(_mixed(24, 12, (1100, 1300), 120, seed=61, long_max_tokens=8), 4, 0.7),),
          llama={"n_ctx": 4 * 2048, "parallel": 4}),
    Fault("interference", "long-decodes-1800-b256", "the same with 1,800-token prompts, llama.cpp -b 256", INTERFERENCE,
          loads=(Load(_mixed(20, 10, (1700, 1900), 140, seed=62, long_max_tokens=8), 3, 0.5),),
          llama={"n_ctx": 3 * 2048, "parallel": 3, "extra_args": ("-b", "256", "-ub", "256")}),
    Fault("interference", "many-short-decodes", "six decodes of 80 tokens, 900-token prompts every fourth", INTERFERENCE,
          loads=(Load(_mixed(36, 12, (850, 950), 80, seed=63, long_max_tokens=4), 6, 1.0),),
          llama={"n_ctx": 6 * 1024, "parallel": 6}),
    # ---- the prefix cache cannot serve a shared system prompt
    Fault("prefix-cache-off", "1000-token-prefix", "24 questions behind one 1,000-token system prompt, cache defeated",
          PREFIX_OFF, loads=(Load(_shared_prefix(24, 1000, seed=71, salted=True), 1),),
          llama={"n_ctx": 2048, "parallel": 1}),
    Fault("prefix-cache-off", "600-token-prefix-2-clients", "600-token prefix, two clients", PREFIX_OFF, quick=True,
          loads=(Load(_shared_prefix(30, 600, seed=72, salted=True), 2),), llama={"n_ctx": 2 * 1024, "parallel": 2}),
    Fault("prefix-cache-off", "1500-token-prefix-open-loop", "1,500-token prefix, Poisson 0.5/s", PREFIX_OFF,
          loads=(Load(_shared_prefix(20, 1500, seed=73, salted=True), 4, 0.5),), llama={"n_ctx": 2 * 2048, "parallel": 2}),
    # ---- two replicas round-robin: a tenant's prefix is cached on a replica only while one of its slots holds it
    # (llama.cpp's host-RAM prompt cache off: --cache-ram 0, as a GPU prefix cache without CPU offload); every
    # tenant is warmed on both replicas before the load, so a miss is the routing's, not a cold start. One thread
    # a replica, so the two do not contend for this machine's two cores
    Fault("routing-misses", "2-replicas-3-tenants", "3 tenants' 900-token prefixes, round-robin over 2 replicas of 2 slots",
          ROUTING, kind="routing", engines=(LLAMACPP,), quick=True,
          loads=(Load(_tenants(72, 3, 900, seed=81), 1),), llama=_replica(2), params={"route": "round-robin"}),
    Fault("routing-misses", "2-replicas-2-tenants", "2 tenants' 1,200-token prefixes, round-robin over 1-slot replicas, "
          "2 clients", ROUTING, kind="routing", engines=(LLAMACPP,), loads=(Load(_tenants(72, 2, 1200, seed=82), 2),),
          llama=_replica(1), params={"route": "round-robin"}),
    Fault("routing-misses", "2-replicas-4-tenants", "4 tenants' 700-token prefixes, round-robin over 2-slot replicas, "
          "Poisson 0.8/s", ROUTING, kind="routing", engines=(LLAMACPP,), loads=(Load(_tenants(80, 4, 700, seed=83), 3, 0.8),),
          llama=_replica(2), params={"route": "round-robin"}),
    # ---- history grows every turn
    Fault("kv-growth", "6x8-turns", "six conversations of 8 turns, ~140 new tokens a turn", GROWTH,
          loads=(Load(_conversations(6, 8, 140, 40, seed=91), 3),), llama={"n_ctx": 3 * 4096, "parallel": 3}),
    Fault("kv-growth", "3x12-turns", "three conversations of 12 turns, ~90 new tokens a turn", GROWTH, quick=True,
          loads=(Load(_conversations(3, 12, 90, 32, seed=92), 3),), llama={"n_ctx": 3 * 4096, "parallel": 3}),
    Fault("kv-growth", "8x6-turns-2-slots", "eight conversations of 6 turns, ~200 new tokens a turn, 2 at a time", GROWTH,
          loads=(Load(_conversations(8, 6, 200, 24, seed=93), 2),), llama={"n_ctx": 2 * 4096, "parallel": 2}),
    # ---- a noisy neighbour on the host
    # on llama.cpp the harm is its two threads meeting at a spin barrier every op: beside two spinners each
    # barrier waits out a scheduler slice and a token takes 0.2-3 s, so these runs take 4-15 min there; the
    # quick run takes this class on vLLM only
    Fault("host-contention", "2-hogs", "light load while two processes spin on the host's two cores", HOST, quick=True,
          quick_engines=(VLLM,), loads=(Load(_short(50, 24, seed=101), 2, 1.2),), hogs=2),
    # one llama.cpp thread has no barrier to miss: the same spinners cost it little (TPOT P99 25 ms), a
    # neighbour that hurts nobody, which must page nobody
    Fault("host-contention", "2-hogs-1-thread", "two spinning processes beside a one-thread llama-server", HOST,
          loads=(Load(_short(40, 24, seed=104), 2, 1.2),), hogs=2, llama={"n_ctx": 4096, "parallel": 2, "threads": 1}),
    Fault("host-contention", "3-hogs-completions", "three spinning processes, completions API", HOST,
          loads=(Load(_short(40, 32, seed=102, api="completions"), 2, 1.0),), hogs=3),
    Fault("host-contention", "2-hogs-4-slots", "two spinning processes, four slots", HOST,
          loads=(Load(_short(60, 24, seed=103), 4, 1.5),), hogs=2, llama={"n_ctx": 4 * 1024, "parallel": 4}),
    # ---- the paged KV cache too small for the sequences in flight (vLLM preempts; llama.cpp has no preemption)
    Fault("kv-pressure", "8x160-in-256-out", "eight sequences of 160+256 tokens on 1,152 tokens of KV", PREEMPT,
          engines=(VLLM,), vllm="small-kv",
          loads=(Load(lambda: [_eos(r) for r in loadgen.long_prompts(16, tokens=160, max_tokens=256, seed=111)], 8),)),
    Fault("kv-pressure", "6x300-in-160-out", "six sequences of 300+160 tokens", PREEMPT, engines=(VLLM,), vllm="small-kv",
          loads=(Load(lambda: [_eos(r) for r in loadgen.long_prompts(14, tokens=300, max_tokens=160, seed=112)], 6),)),
    Fault("kv-pressure", "8x80-in-360-out", "eight sequences of 80+360 tokens", PREEMPT, engines=(VLLM,), vllm="small-kv", quick=True,
          loads=(Load(lambda: [_eos(r) for r in loadgen.long_prompts(12, tokens=80, max_tokens=360, seed=113)], 8),)),
    # ---- prompts longer than the context a request may have
    Fault("context-overflow", "half-over-512", "half the prompts ~700 tokens against 512 a request", OVERFLOW, quick=True,
          vllm="small-kv", llama={"n_ctx": 4 * 512, "parallel": 4},
          loads=(Load(_mixed(20, 20, (650, 750), 24, seed=121), 4),)),
    Fault("context-overflow", "third-over-completions", "a third ~900 tokens, completions API", OVERFLOW, vllm="small-kv",
          llama={"n_ctx": 2 * 512, "parallel": 2}, loads=(Load(_mixed(30, 15, (800, 1000), 16, seed=122, api="completions"), 3),)),
    Fault("context-overflow", "long-output", "prompts of ~300 tokens asking for 400 tokens", OVERFLOW, vllm="small-kv",
          llama={"n_ctx": 4 * 512, "parallel": 4},
          loads=(Load(lambda: [_eos(r) for r in loadgen.long_prompts(24, tokens=300, max_tokens=400, seed=123)], 4),)),
    # ---- the engine dies mid-load (llama.cpp: SIGKILL; vLLM 0.32 CPU: a seeded request whose prompt is chunked)
    Fault("crash", "at-15s", "the engine dies 15 s into a steady load", CRASH, kind="crash", quick=True,
          loads=(Load(_short(60, 24, seed=131), 2, 1.5),), params={"at_s": 15}),
    Fault("crash", "at-25s-4-clients", "dies 25 s in, four clients", CRASH, kind="crash",
          loads=(Load(_short(80, 24, seed=132), 4, 2.0),), params={"at_s": 25}, llama={"n_ctx": 4 * 1024, "parallel": 4}),
    Fault("crash", "at-10s-completions", "dies 10 s in, completions API", CRASH, kind="crash",
          loads=(Load(_short(50, 16, seed=133, api="completions"), 2, 1.2),), params={"at_s": 10}),
    # ---- a gateway's rate limit (nginx limit_req, 429) in front of the engine
    Fault("rate-limit", "2-per-s-at-6", "gateway 2/s burst 2; Poisson 6/s", RATE, kind="gateway", quick=True,
          loads=(Load(_short(36, 8, seed=141), 36, 6.0),), params={"rate": "2r/s", "burst": 2}),
    Fault("rate-limit", "1-per-s-at-3", "gateway 1/s burst 1; Poisson 3/s", RATE, kind="gateway",
          loads=(Load(_short(30, 8, seed=142), 30, 3.0),), params={"rate": "1r/s", "burst": 1}),
    Fault("rate-limit", "4-per-s-at-12-completions", "gateway 4/s burst 4; Poisson 12/s, completions", RATE,
          kind="gateway", loads=(Load(_short(60, 8, seed=143, api="completions"), 60, 12.0),), params={"rate": "4r/s", "burst": 4}),
    # ---- clients that give up mid-stream: not the server's fault, nothing may page
    Fault("client-disconnects", "half-give-up-at-1s", "every other client disconnects after 1 s", (),
          loads=(Load(_disconnecting(40, 96, 1.0, seed=151), 3, 1.0),)),
    Fault("client-disconnects", "half-give-up-at-3s", "every other client disconnects after 3 s", (),
          loads=(Load(_disconnecting(40, 160, 3.0, seed=152), 2, 0.8),)),
    Fault("client-disconnects", "give-up-at-0.5s", "every other client disconnects after 0.5 s, 4 slots", (), quick=True,
          loads=(Load(_disconnecting(50, 64, 0.5, seed=153), 4, 1.5),), llama={"n_ctx": 4 * 1024, "parallel": 4}),
    # ---- KV cache quantised: long-context answers drift from the f16 baseline (llama.cpp -ctk/-ctv)
    Fault("kv-quant", "q4_0", "K and V in q4_0 against f16", QUANT, kind="quality", engines=(LLAMACPP,), quick=True,
          params={"kv": "q4_0"}),
    Fault("kv-quant", "q4_1", "K and V in q4_1 against f16", QUANT, kind="quality", engines=(LLAMACPP,),
          params={"kv": "q4_1"}),
    Fault("kv-quant", "iq4_nl", "K and V in iq4_nl against f16", QUANT, kind="quality", engines=(LLAMACPP,),
          params={"kv": "iq4_nl"}),
    # ---- the serving process's memory grows at flat load (a shim in front of llama-server keeps part of every
    # request). The leak rule holds 10 min (a leak is a trend, not a spike) on windows that look back 5 min, so
    # a run lasts 16 min: the first window closes at 5 min, the hold is met at ~14 min
    Fault("memory-leak", "256k-per-request", "a front process that keeps 256 KiB per request, 1 req/s for 16 min", LEAK,
          kind="leak", engines=(LLAMACPP,), loads=(Load(_short(960, 8, seed=161), 2, 1.0),), params={"leak_kib": 256}),
    Fault("memory-leak", "64k-at-2-per-s", "64 KiB per request, 2 req/s for 16 min, completions API", LEAK,
          kind="leak", engines=(LLAMACPP,), loads=(Load(_short(1920, 8, seed=162, api="completions"), 3, 2.0),),
          params={"leak_kib": 64}),
    Fault("memory-leak", "1m-at-0.4-per-s", "1 MiB per request, 0.4 req/s for 16 min", LEAK,
          kind="leak", engines=(LLAMACPP,), loads=(Load(_short(384, 16, seed=163), 1, 0.4),), params={"leak_kib": 1024}),
    # ---- controls: healthy at three loads, and more load that stays within objectives
    Fault("control", "light", "one user, Poisson 0.4/s, short prompts", (),
          loads=(Load(_short(20, 24, seed=171), 1, 0.4),)),
    Fault("control", "medium", "two users, Poisson 1/s, prompts of 10-300 tokens", (),
          loads=(Load(_mixed(30, 10, (100, 300), 24, seed=172), 2, 1.0),)),
    Fault("control", "heavier", "three users on four slots, Poisson 1.5/s, completions API", (),
          loads=(Load(_short(60, 24, seed=173, api="completions"), 3, 1.5),), llama={"n_ctx": 4 * 1024, "parallel": 4}),
    Fault("control", "more-load-within-objectives", "twice the medium rate on four slots, outputs of 16 tokens", (),
          quick=True, loads=(Load(_short(60, 16, seed=174), 4, 2.0),), llama={"n_ctx": 4 * 1024, "parallel": 4}),
    Fault("control", "session-affinity", "the 3-tenant routing load with the router hashing the tenant (two on one "
          "replica, one on the other): every prefix stays in a slot", (), kind="routing", engines=(LLAMACPP,),
          loads=(Load(_tenants(72, 3, 900, seed=81), 1),), llama=_replica(2), params={"route": "affinity"}),
    Fault("control", "kv-q8_0", "K and V in q8_0 against f16: outputs stay with the baseline", (), kind="quality",
          engines=(LLAMACPP,), params={"kv": "q8_0"}),
)


def cut(requests: list[ChatRequest], share: float) -> list[ChatRequest]:
    """The first ``share`` of a load's requests (at least :data:`QUICK_MIN_REQUESTS`); chained
    conversations are kept whole (a conversation cut mid-way would still be sent, turn by turn,
    but its later turns are the growth a kv-growth run is about), so the first ``share`` of them."""
    if share >= 1.0:
        return requests
    sessions = list(dict.fromkeys(r.session_id for r in requests if r.chain))
    if sessions:
        keep = set(sessions[:max(2, int(np.ceil(len(sessions) * share)))])
        return [r for r in requests if not r.chain or r.session_id in keep]
    return requests[:max(QUICK_MIN_REQUESTS, int(np.ceil(len(requests) * share)))]


def _eos(r: ChatRequest) -> ChatRequest:
    r.extra_body["ignore_eos"] = True
    return r


def select(quick: bool = False, engines: tuple[str, ...] = BOTH, classes: tuple[str, ...] = ()) -> list[tuple[Fault, str]]:
    """(fault, engine) pairs to run, in an order that shares server starts: llama.cpp first, then
    vLLM by shared server, the crash last on its server (it kills it); the 16-minute leak runs last."""
    runs = [(f, e) for f in FAULTS for e in f.engines if e in engines
            and (not quick or f.quick and e in (f.quick_engines or f.engines)) and (not classes or f.cls in classes or f.id in classes)]
    return sorted(runs, key=lambda fe: (fe[0].kind == "leak", fe[1] == VLLM, fe[0].vllm if fe[1] == VLLM else "", fe[0].kind == "crash"))
