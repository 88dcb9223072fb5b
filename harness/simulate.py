"""A small queueing model of an inference server, for rule test cases and benchmarks.

It is not a stand-in for a real server (the real-server harness is); it makes captures whose
behaviour *emerges* from a mechanism (slots, a serialised prefill engine, decode that slows
with batch size and context) rather than numbers painted to match a rule's thresholds.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from kvdoctor.model import RequestRecord


@dataclass
class ServerModel:
    slots: int = 4
    prefill_base_s: float = 0.01
    prefill_s_per_token: float = 0.0001
    tpot_base_s: float = 0.008
    #: relative TPOT increase per extra sequence decoding at the same time
    tpot_per_extra_seq: float = 0.05
    #: relative TPOT increase per 1,000 tokens of context
    tpot_per_1k_ctx: float = 0.02
    #: longest sequence a slot holds; longer requests are rejected
    ctx_per_slot: int = 1_000_000
    #: serve shared prefixes from cache (needs prefix_block_hashes on requests)
    prefix_cache: bool = False
    block_tokens: int = 64
    stall_prob: float = 0.0
    stall_s: float = 0.0
    #: KV tokens the whole cache holds; a request whose prompt + output would not fit beside the
    #: sequences already running fails when admitted, as an engine without preemption does
    #: (llama.cpp "failed to find free space in the KV cache"). None: unbounded
    kv_tokens: int | None = None
    seed: int = 0


@dataclass
class Workload:
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    session: list[str | None] = field(default_factory=list)
    turn: list[int | None] = field(default_factory=list)
    prefix_blocks: list[list[int] | None] = field(default_factory=list)


def simulate(wl: Workload, m: ServerModel, t0: float = 1_767_000_000.0, server: str | None = None) -> list[RequestRecord]:
    rng = np.random.default_rng(m.seed)
    slot_free = [t0] * m.slots
    heapq.heapify(slot_free)
    prefill_free = t0
    seen_blocks: set[int] = set()
    live: list[tuple[float, int]] = []  # (finish, KV tokens) of admitted sequences, for kv_tokens
    out = []
    for i in np.argsort(wl.arrival_s, kind="stable"):
        arrival = t0 + float(wl.arrival_s[i])
        prompt, want = int(wl.prompt_tokens[i]), int(wl.output_tokens[i])
        blocks = wl.prefix_blocks[i] if wl.prefix_blocks else None
        common = dict(request_id=f"r{i}", arrival_s=arrival, prompt_tokens=prompt, server=server,
                      session_id=wl.session[i] if wl.session else None, turn=wl.turn[i] if wl.turn else None,
                      prefix_block_hashes=blocks, prefix_block_tokens=m.block_tokens if blocks else None)
        if prompt + want > m.ctx_per_slot:
            out.append(RequestRecord(**common, finish_s=arrival + 0.002, e2e_s=0.002, status="rejected", http_status=400,
                                     error="the request exceeds the available context size"))
            continue
        free_at = heapq.heappop(slot_free)
        start = max(arrival, free_at)
        if m.kv_tokens is not None:
            live = [(f, n) for f, n in live if f > start]  # sequences still holding KV at admission
            if sum(n for _, n in live) + prompt + want > m.kv_tokens:
                heapq.heappush(slot_free, free_at)
                out.append(RequestRecord(**common, finish_s=start + 0.01, e2e_s=start + 0.01 - arrival, status="error",
                                         http_status=500, error="failed to find free space in the KV cache"))
                continue
        cached = 0
        if blocks:
            lead = 0
            for b in blocks:
                if b not in seen_blocks:
                    break
                lead += 1
            if m.prefix_cache:
                cached = min(lead * m.block_tokens, prompt - 1)
            seen_blocks.update(blocks)
        pf_start = max(start, prefill_free)
        pf_end = pf_start + m.prefill_base_s + m.prefill_s_per_token * (prompt - cached)
        prefill_free = pf_end
        busy = sum(1 for f in slot_free if f > pf_end) + 1
        ctx = prompt + want / 2
        tpot = m.tpot_base_s * (1 + m.tpot_per_extra_seq * (busy - 1)) * (1 + m.tpot_per_1k_ctx * ctx / 1000)
        tpot *= float(rng.lognormal(0, 0.05))
        if m.stall_prob and rng.random() < m.stall_prob:
            tpot += m.stall_s / max(want - 1, 1)
        finish = pf_end + tpot * max(want - 1, 0)
        heapq.heappush(slot_free, finish)
        if m.kv_tokens is not None:
            live.append((finish, prompt + want))
        out.append(RequestRecord(**common, first_token_s=pf_end, finish_s=finish, queue_s=start - arrival,
                                 ttft_s=pf_end - arrival, e2e_s=finish - arrival, tpot_s=tpot, output_tokens=want,
                                 cached_prompt_tokens=cached if blocks else None, status="ok"))
    return out
