"""Regenerate the rule test captures in this folder (deterministic; run from the repo root):

    python tests/rulecases/make_cases.py            # rewrites the cases in this folder
    python tests/rulecases/make_cases.py OUT_DIR    # writes them under OUT_DIR instead

Each case is a small capture from harness.simulate: a server mechanism (slots,
serialised prefill, bandwidth-shared decode, prefix cache) driven by a workload. They are the
rules' unit cases; the real-server captures in samples/ are the end-to-end proof.

No case writes the signal its rule tests: engine, GPU and quality samples are computed here from
the simulated requests through a stated mechanism (bytes per decode step over peak bandwidth;
KV blocks reserved per running sequence; sequences that do not fit evicted; memory kept per
finished request; attention-score noise of a few-bit KV cache), so a rule fires only if the
mechanism, not a painted number, produces its symptom.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.simulate import ServerModel, Workload, simulate  # noqa: E402
from kvdoctor.capture import CaptureWriter  # noqa: E402
from kvdoctor.model import CaptureMeta, EngineSample, GpuSample, HostSample, RequestRecord  # noqa: E402

HERE = Path(sys.argv[1]).resolve() if __name__ == "__main__" and len(sys.argv) > 1 else Path(__file__).resolve().parent
T0 = 1_767_000_000.0


def poisson(rng, n, rate):
    return np.cumsum(rng.exponential(1 / rate, n))


def write(name: str, records, meta: CaptureMeta, extra=()):
    folder = HERE / name
    shutil.rmtree(folder, ignore_errors=True)
    with CaptureWriter(folder, meta) as w:
        w.write_many(records)
        w.write_many(extra)
    print(f"{name}: {sum(1 for r in records if isinstance(r, RequestRecord))} requests")


def meta(**config) -> CaptureMeta:
    return CaptureMeta(created_unix_s=T0, engine=config.pop("engine", "llamacpp"), model="simulated",
                       origin="simulate", config=config)


def running_at(recs, t: float) -> list:
    """The simulated requests decoding or prefilling at instant t (absolute seconds)."""
    return [r for r in recs if r.first_token_s is not None and r.arrival_s <= t <= r.finish_s]


def live_tokens(r, t: float) -> float:
    """KV tokens request r holds at instant t: its prompt plus the output generated so far."""
    done = min(1.0, max(0.0, (t - r.first_token_s) / max(r.finish_s - r.first_token_s, 1e-9)))
    return r.prompt_tokens + (r.output_tokens or 0) * done


def bandwidth_use(recs, t: float, weights_b: float = 16.06e9, kv_b_per_token: float = 131072,
                  peak_b_per_s: float = 2.0e12) -> float:
    """DRAM bandwidth use at t: bytes one decode step reads (the weights once, plus every running
    sequence's KV) x steps per second (1 / the running sequences' TPOT) / peak bandwidth. By
    default an 8B model in bf16 (16 GB, 128 KiB of KV per token) on a 2 TB/s GPU."""
    run = running_at(recs, t)
    if not run:
        return 0.0
    step_b = weights_b + kv_b_per_token * sum(live_tokens(r, t) for r in run)
    return min(step_b / float(np.median([r.tpot_s for r in run])) / peak_b_per_s, 1.0)


def waiting_at(recs, t: float) -> int:
    """Requests that have arrived and not yet got a slot (the engine's waiting-queue gauge)."""
    return sum(1 for r in recs if r.queue_s and r.arrival_s <= t < r.arrival_s + r.queue_s)


def short_workload(rng, n=400, rate=1.0):
    return Workload(poisson(rng, n, rate), rng.integers(80, 300, n), rng.integers(40, 160, n))


def healthy():
    rng = np.random.default_rng(1)
    recs = simulate(short_workload(rng), ServerModel(slots=4, seed=1), T0)
    capacity = 4 * 8192  # 4 slots of 8,192 tokens
    gpu = [GpuSample(time_s=T0 + t, gpu_index=0, mem_used_bytes=40 * 2**30, mem_total_bytes=80 * 2**30,
                     mem_util_frac=bandwidth_use(recs, T0 + t)) for t in range(0, 400, 2)]
    eng = [EngineSample(time_s=T0 + t, engine="vllm", values={
        "kv_usage_frac": sum(live_tokens(r, T0 + t) for r in running_at(recs, T0 + t)) / capacity,
        "preemptions_total": 0.0, "requests_waiting": float(waiting_at(recs, T0 + t))}) for t in range(0, 400, 5)]
    write("healthy", recs, meta(max_running_requests=4, context_len_tokens=8192, cache_type_k="f16"), gpu + eng)


def long_prompts():
    rng = np.random.default_rng(2)
    n = 400
    long_ = rng.random(n) < 0.2
    prompt = np.where(long_, rng.integers(3000, 7000, n), rng.integers(80, 250, n))
    wl = Workload(poisson(rng, n, 1.0), prompt, rng.integers(40, 120, n))
    recs = simulate(wl, ServerModel(slots=4, prefill_s_per_token=0.0004, seed=2), T0)
    write("long-prompts", recs, meta(max_running_requests=4, context_len_tokens=16384))


def concurrency():
    rng = np.random.default_rng(3)
    n = 600
    rate = np.where(np.arange(n) < 300, 0.5, 6.0)  # load ramps up
    arrival = np.cumsum(rng.exponential(1 / rate))
    wl = Workload(arrival, rng.integers(80, 300, n), rng.integers(100, 300, n))
    recs = simulate(wl, ServerModel(slots=16, tpot_per_extra_seq=0.12, seed=3), T0)
    end = max(r.finish_s for r in recs) - T0
    gpu = [GpuSample(time_s=T0 + t, gpu_index=0, mem_used_bytes=60 * 2**30, mem_total_bytes=80 * 2**30,
                     dram_bw_util_frac=bandwidth_use(recs, T0 + t)) for t in np.arange(0, end, 2.0)]
    write("concurrency", recs, meta(max_running_requests=16, context_len_tokens=4096), gpu)


def multi_turn(window_tokens: int | None = None):
    """Conversations of 10 turns, each resending its history. With `window_tokens` the client
    keeps only that much history (a sliding window): the same turns, no growth per turn."""
    rng = np.random.default_rng(4)
    convs, turns = 40, 10
    arrival, prompt, out, session, turn = [], [], [], [], []
    for c in range(convs):
        t = rng.uniform(0, 120)
        history = rng.integers(60, 120)
        for k in range(1, turns + 1):
            reply = int(rng.integers(80, 160))
            arrival.append(t)
            prompt.append(history + 30)
            out.append(reply)
            session.append(f"conv{c}")
            turn.append(k)
            history += 30 + reply
            if window_tokens is not None:
                history = min(history, window_tokens)
            t += rng.uniform(8, 15)
    wl = Workload(np.array(arrival), np.array(prompt), np.array(out), session, turn)
    recs = simulate(wl, ServerModel(slots=8, tpot_per_1k_ctx=0.25, prefill_s_per_token=0.0002, seed=4), T0)
    name = "multi-turn" if window_tokens is None else "multi-turn-bounded"
    write(name, recs, meta(max_running_requests=8, context_len_tokens=8192))


def context_overflow():
    rng = np.random.default_rng(5)
    n = 300
    prompt = np.where(rng.random(n) < 0.3, rng.integers(1500, 3000, n), rng.integers(100, 600, n))
    wl = Workload(poisson(rng, n, 4.0), prompt, rng.integers(100, 300, n))
    recs = simulate(wl, ServerModel(slots=8, ctx_per_slot=2048, seed=5), T0)
    write("context-overflow", recs, meta(max_running_requests=8, context_len_tokens=2048))


def kv_oom():
    """Long sequences at high concurrency against a KV cache that holds ~4 of them: admissions
    that do not fit fail (an engine without preemption), from the cache's capacity alone."""
    rng = np.random.default_rng(11)
    n = 200
    prompt = rng.integers(800, 2400, n)
    wl = Workload(poisson(rng, n, 3.0), prompt, rng.integers(200, 500, n))
    recs = simulate(wl, ServerModel(slots=8, kv_tokens=8192, prefill_s_per_token=0.00005, seed=11), T0)
    write("kv-oom", recs, meta(max_running_requests=8, context_len_tokens=4096, kv_capacity_tokens=8192))


def quantised_kv_repetition(rng, context_tokens: np.ndarray, bits: int, logit_gap: float = 0.3) -> np.ndarray:
    """Share of repeated n-grams in outputs from a KV cache stored in `bits` bits. A uniform
    quantiser's error (step / sqrt(12), step = 2 / 2^bits of a unit range) perturbs attention;
    taken here to add up as sqrt(context / 64) over the context, and greedy decoding to fall
    into loops (logistic in the noise) once it passes the gap between the top two next-token
    logits. The gap is an assumption, not a measurement (which is why kv-quant-quality stays
    experimental until a real run shows the effect); f16 (bits=16) leaves the noise ~0."""
    step = 2.0 / 2**bits
    score_noise = step / np.sqrt(12) * np.sqrt(context_tokens / 64)
    p_loop = 1 / (1 + np.exp(-(score_noise - logit_gap) / 0.1))
    return np.clip(0.03 + 0.8 * p_loop + rng.normal(0, 0.03, len(context_tokens)), 0, 1)


def kv_quant():
    rng = np.random.default_rng(6)
    n = 60
    prompt = rng.integers(200, 8000, n)
    wl = Workload(poisson(rng, n, 0.1), prompt, np.full(n, 200))
    recs = simulate(wl, ServerModel(slots=4, seed=6), T0)
    rep = quantised_kv_repetition(rng, prompt + 100.0, bits=4)  # q4_0 K and V
    recs = [r.__class__(**{**{f: getattr(r, f) for f in r.__slots__}, "output_repetition": float(x)})
            for r, x in zip(recs, rep)]
    write("kv-quant", recs, meta(max_running_requests=4, context_len_tokens=16384, cache_type_k="q4_0", cache_type_v="q4_0"))


def tail():
    rng = np.random.default_rng(7)
    recs = simulate(short_workload(rng, 500, 1.5), ServerModel(slots=8, stall_prob=0.04, stall_s=20.0, seed=7), T0)
    write("tail", recs, meta(max_running_requests=8))


def prefix(cache_on: bool):
    rng = np.random.default_rng(8)
    n = 300
    system = list(range(1000, 1024))  # 24 shared blocks of 64 tokens = a 1,536-token system prompt
    blocks = [system + [int(x) for x in rng.integers(10**9, 2 * 10**9, 3)] for _ in range(n)]
    wl = Workload(poisson(rng, n, 1.0), np.full(n, 27 * 64 - 10), rng.integers(40, 120, n), prefix_blocks=blocks)
    recs = simulate(wl, ServerModel(slots=4, prefix_cache=cache_on, prefill_s_per_token=0.0003, seed=8), T0)
    write(f"prefix-cache-{'on' if cache_on else 'off'}", recs, meta(max_running_requests=4))


def preemption():
    """Long requests at high concurrency fill the KV cache; what does not fit is evicted."""
    rng = np.random.default_rng(9)
    n = 400
    wl = Workload(poisson(rng, n, 2.0), rng.integers(1500, 3000, n), rng.integers(200, 400, n))
    recs = simulate(wl, ServerModel(slots=32, tpot_per_extra_seq=0.02, seed=9), T0)
    capacity = 1000 * 16  # 1,000 blocks of 16 tokens
    eng, total, evicted = [], 0, set()
    end = max(r.finish_s for r in recs) - T0
    for t in np.arange(0, end, 5.0):
        now = T0 + t
        held = 0.0
        # vLLM's recompute policy: the earliest arrivals keep their blocks, the latest are
        # preempted once the cache is full; each newly evicted sequence counts once
        for r in sorted(running_at(recs, now), key=lambda r: r.arrival_s):
            need = live_tokens(r, now)
            if held + need <= capacity:
                held += need
            elif r.request_id not in evicted:
                evicted.add(r.request_id)
                total += 1
        eng.append(EngineSample(time_s=now, engine="vllm", values={
            "kv_usage_frac": held / capacity, "preemptions_total": float(total),
            "requests_waiting": float(waiting_at(recs, now))}))
    write("preemption", recs, meta(engine="vllm", max_running_requests=32, kv_num_gpu_blocks=1000, kv_block_size_tokens=16), eng)


def queueing():
    rng = np.random.default_rng(10)
    wl = short_workload(rng, 400, 3.0)
    recs = simulate(wl, ServerModel(slots=2, tpot_base_s=0.01, seed=10), T0)
    write("queueing", recs, meta(max_running_requests=2, context_len_tokens=4096))


def fragmentation():
    """An engine that reserves blocks for the whole context limit of each running sequence up
    front (static per-sequence allocation) instead of as tokens arrive: the cache looks full
    while the tokens in it are few."""
    rng = np.random.default_rng(11)
    recs = simulate(short_workload(rng, 1200, 4.0), ServerModel(slots=8, seed=11), T0)
    block, blocks_total, reserve_tokens = 16, 2048, 6144  # 32,768 tokens; 6,144 reserved a sequence
    end = max(r.finish_s for r in recs) - T0
    eng = []
    for t in np.arange(0, end, 5.0):
        run = running_at(recs, T0 + t)
        used_blocks = sum(-(-max(reserve_tokens, live_tokens(r, T0 + t)) // block) for r in run)
        eng.append(EngineSample(time_s=T0 + t, engine="vllm", values={
            "kv_usage_frac": min(used_blocks / blocks_total, 1.0), "preemptions_total": 0.0}))
    write("fragmentation", recs, meta(engine="vllm", max_running_requests=8, kv_num_gpu_blocks=blocks_total,
                                      kv_block_size_tokens=block), eng)


def leak(leak_mib_per_request: float = 0.4):
    """Each finished request leaves 0.4 MiB of GPU memory allocated (a per-request leak). With
    0 it is the same server and load without the leak: memory flat with noise (`steady-memory`)."""
    rng = np.random.default_rng(12)
    recs = simulate(short_workload(rng, 1500, 1.0), ServerModel(slots=4, seed=12), T0)
    finished = np.sort([r.finish_s for r in recs])
    leak_b_per_request, base_b = leak_mib_per_request * 2**20, 30 * 2**30
    gpu = [GpuSample(time_s=T0 + t, gpu_index=0, mem_total_bytes=80 * 2**30, mem_util_frac=0.3,
                     mem_used_bytes=int(base_b + leak_b_per_request * np.searchsorted(finished, T0 + t)
                                        + rng.normal(0, 2**20)))
           for t in range(0, 1500, 10)]
    host = [HostSample(time_s=T0 + t, server_rss_bytes=4 * 2**30, server_cpu_cores=1.0) for t in range(0, 1500, 10)]
    write("leak" if leak_mib_per_request else "steady-memory", recs, meta(max_running_requests=4), gpu + host)


if __name__ == "__main__":
    for make in (healthy, long_prompts, concurrency, multi_turn, context_overflow, kv_oom, kv_quant, tail,
                 lambda: prefix(True), lambda: prefix(False), preemption, queueing, fragmentation, leak,
                 lambda: multi_turn(window_tokens=240), lambda: leak(0.0)):
        make()

