"""Regenerate the rule test captures in this folder (deterministic; run from the repo root):

    python tests/rulecases/make_cases.py

Each case is a small capture from kvdoctor.testing.simulate: a server mechanism (slots,
serialised prefill, bandwidth-shared decode, prefix cache) driven by a workload. They are the
rules' unit cases; the real-server captures in samples/ are the end-to-end proof.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvdoctor.capture import CaptureWriter  # noqa: E402
from kvdoctor.model import CaptureMeta, EngineSample, GpuSample, HostSample, RequestRecord  # noqa: E402
from kvdoctor.testing.simulate import ServerModel, Workload, simulate  # noqa: E402

HERE = Path(__file__).resolve().parent
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


def short_workload(rng, n=400, rate=1.0):
    return Workload(poisson(rng, n, rate), rng.integers(80, 300, n), rng.integers(40, 160, n))


def healthy():
    rng = np.random.default_rng(1)
    recs = simulate(short_workload(rng), ServerModel(slots=4, seed=1), T0)
    gpu = [GpuSample(time_s=T0 + t, gpu_index=0, mem_used_bytes=40 * 2**30, mem_total_bytes=80 * 2**30,
                     mem_util_frac=0.3 + 0.05 * np.sin(t / 30)) for t in range(0, 400, 2)]
    eng = [EngineSample(time_s=T0 + t, engine="vllm", values={"kv_usage_frac": 0.2, "preemptions_total": 0.0,
                                                              "requests_waiting": 0.0}) for t in range(0, 400, 5)]
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
    busy = lambda t: sum(1 for r in recs if r.arrival_s <= T0 + t <= r.finish_s)  # noqa: E731
    gpu = [GpuSample(time_s=T0 + t, gpu_index=0, mem_used_bytes=60 * 2**30, mem_total_bytes=80 * 2**30,
                     dram_bw_util_frac=min(0.2 + 0.06 * busy(t), 0.97)) for t in np.arange(0, end, 2.0)]
    write("concurrency", recs, meta(max_running_requests=16, context_len_tokens=4096), gpu)


def multi_turn():
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
            t += rng.uniform(8, 15)
    wl = Workload(np.array(arrival), np.array(prompt), np.array(out), session, turn)
    recs = simulate(wl, ServerModel(slots=8, tpot_per_1k_ctx=0.25, prefill_s_per_token=0.0002, seed=4), T0)
    write("multi-turn", recs, meta(max_running_requests=8, context_len_tokens=8192))


def context_overflow():
    rng = np.random.default_rng(5)
    n = 300
    prompt = np.where(rng.random(n) < 0.3, rng.integers(1500, 3000, n), rng.integers(100, 600, n))
    wl = Workload(poisson(rng, n, 4.0), prompt, rng.integers(100, 300, n))
    recs = simulate(wl, ServerModel(slots=8, ctx_per_slot=2048, seed=5), T0)
    write("context-overflow", recs, meta(max_running_requests=8, context_len_tokens=2048))


def kv_quant():
    rng = np.random.default_rng(6)
    n = 60
    prompt = rng.integers(200, 8000, n)
    wl = Workload(poisson(rng, n, 0.1), prompt, np.full(n, 200))
    recs = simulate(wl, ServerModel(slots=4, seed=6), T0)
    # degeneration that grows with context, as measured on q4_0 K/V at long context
    rep = np.clip(0.05 + 0.6 * (prompt - 2000) / 6000, 0.02, 0.9) + rng.normal(0, 0.03, n)
    recs = [r.__class__(**{**{f: getattr(r, f) for f in r.__slots__}, "output_repetition": float(np.clip(x, 0, 1))})
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
    """Long requests at high concurrency fill the KV cache; the engine preempts when full."""
    rng = np.random.default_rng(9)
    n = 400
    wl = Workload(poisson(rng, n, 2.0), rng.integers(1500, 3000, n), rng.integers(200, 400, n))
    recs = simulate(wl, ServerModel(slots=32, tpot_per_extra_seq=0.02, seed=9), T0)
    capacity = 1000 * 16
    eng, total = [], 0.0
    end = max(r.finish_s for r in recs) - T0
    for t in np.arange(0, end, 5.0):
        now = T0 + t
        live = sum(r.prompt_tokens + r.output_tokens * min(1.0, (now - r.first_token_s) / max(r.finish_s - r.first_token_s, 1e-9))
                   for r in recs if r.first_token_s is not None and r.arrival_s <= now <= r.finish_s)
        usage = min(live / capacity, 1.0)
        total += rng.integers(2, 8) if usage > 0.95 else 0
        eng.append(EngineSample(time_s=now, engine="vllm", values={
            "kv_usage_frac": float(usage), "preemptions_total": float(total), "requests_waiting": 0.0}))
    write("preemption", recs, meta(engine="vllm", max_running_requests=32, kv_num_gpu_blocks=1000, kv_block_size_tokens=16), eng)


def queueing():
    rng = np.random.default_rng(10)
    wl = short_workload(rng, 400, 3.0)
    recs = simulate(wl, ServerModel(slots=2, tpot_base_s=0.01, seed=10), T0)
    write("queueing", recs, meta(max_running_requests=2, context_len_tokens=4096))


def fragmentation():
    rng = np.random.default_rng(11)
    recs = simulate(short_workload(rng, 400, 1.0), ServerModel(slots=8, seed=11), T0)
    eng = [EngineSample(time_s=T0 + t, engine="vllm", values={"kv_usage_frac": 0.9, "preemptions_total": 0.0})
           for t in range(0, 420, 5)]
    write("fragmentation", recs, meta(engine="vllm", max_running_requests=8, kv_num_gpu_blocks=2048, kv_block_size_tokens=16), eng)


def leak():
    rng = np.random.default_rng(12)
    recs = simulate(short_workload(rng, 1500, 1.0), ServerModel(slots=4, seed=12), T0)
    gpu = [GpuSample(time_s=T0 + t, gpu_index=0, mem_used_bytes=int(30 * 2**30 + t * 2**20 * 0.4 + rng.normal(0, 2**20)),
                     mem_total_bytes=80 * 2**30, mem_util_frac=0.3) for t in range(0, 1500, 10)]
    host = [HostSample(time_s=T0 + t, server_rss_bytes=4 * 2**30, server_cpu_cores=1.0) for t in range(0, 1500, 10)]
    write("leak", recs, meta(max_running_requests=4), gpu + host)



if __name__ == "__main__":
    for make in (healthy, long_prompts, concurrency, multi_turn, context_overflow, kv_quant, tail,
                 lambda: prefix(True), lambda: prefix(False), preemption, queueing, fragmentation, leak):
        make()

