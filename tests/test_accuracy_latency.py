"""Latency verdicts on public real runs (issue 12, classes 1-4, 6, 9): the AIBrix QPS sweep of
Llama-3.1-8B on an A100-80GB under vLLM (tests/data/traces/aibrix, see tests/data/SOURCES.md)
and the real llama-server samples. Expected verdicts are written from the raw numbers of the
source files, which the tests recompute from the CSV where they compare."""
import csv
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import kvdoctor
from kvdoctor.capture.memory import from_records
from kvdoctor.cli import cli
from kvdoctor.diagnosis import diagnose
from kvdoctor.model import EngineSample, derive_request
from kvdoctor.signals import Prepared
from kvdoctor.signals.registry import fit

from conftest import request_records
from rule_gates import could_fire

ROOT = Path(__file__).resolve().parent.parent
AIBRIX = ROOT / "tests" / "data" / "traces" / "aibrix"
SAMPLES = ROOT / "samples"
COLS = ["--col", "arrival_s=launch_time", "--col", "finish_s=finish_time", "--col", "ttft_s=ttft",
        "--col", "prompt_tokens=prompt_tokens", "--col", "output_tokens=generation_tokens",
        "--col", "session_id=user_id", "--model", "Llama-3.1-8B", "--engine", "vllm"]


def _import(tmp_path, qps: str, gpu: str | None = "A100-80GB"):
    out = tmp_path / f"aibrix-{qps}-{gpu}"
    extra = ["--gpu", gpu] if gpu else []
    if out.exists():
        return kvdoctor.load(out)
    cli.main(args=["import", "csv", str(AIBRIX / f"naive_output_{qps}.csv"), "-o", str(out), *COLS, *extra],
             standalone_mode=False)
    return kvdoctor.load(out)


def _raw(qps: str) -> dict[str, np.ndarray]:
    with open(AIBRIX / f"naive_output_{qps}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([float(r[k]) for r in rows]) for k in rows[0] if k not in ("user_id", "question_id")}


def _whole(cap):
    p = Prepared(cap)
    return p.window(p.start_s, p.end_s)


def _causes(diag) -> dict[str, object]:
    return {c.rule.id: c for inc in diag.incidents for c in inc.causes}


# -- class 1: a server slow for everyone -------------------------------------------------------

def test_saturated_run_is_queueing_by_littles_law(tmp_path):
    """QPS 2.5: median TTFT 8.5 s against ~3 s at low load, TPOT 217 ms against 13 ms; was
    "No incident". Now the top incident is a backlog, and its evidence matches the raw file."""
    diag = diagnose(_import(tmp_path, "2.5"))
    assert diag.incidents, "a saturated run must not be 'No incident'"
    top = diag.incidents[0].causes[0]
    assert top.rule.id == "queueing-saturation" and top.cause.startswith("A backlog builds")
    # ground truth from the CSV: arrivals vs completions between the first and last launch
    raw = _raw("2.5")
    a0, a1 = raw["launch_time"].min(), raw["launch_time"].max()
    done = np.sum((raw["finish_time"] >= a0) & (raw["finish_time"] <= a1))
    assert top.evidence["arrivals_over_completions"] == pytest.approx(len(raw["launch_time"]) / done, rel=1e-6)
    assert top.evidence["arrivals_over_completions"] > 1.25
    assert top.evidence["inflight_over_littles_law"] >= 2
    # the low-load TTFT is the run's own early, unloaded requests: the first launches' TTFT
    first = np.argsort(raw["launch_time"])[:5]
    assert top.evidence["ttft_low_load_p50_s"] == pytest.approx(np.median(raw["ttft"][first]), rel=0.25)


def test_littles_law_ratio_rises_with_offered_load(tmp_path):
    """Across the sweep the same server holds ever more requests per unit of low-load latency;
    below capacity (0.5, 1.3 QPS) it keeps up (ratio under 2, no backlog)."""
    vals = {q: _whole(_import(tmp_path, q)).value("inflight_over_littles_law") for q in ("0.5", "1.3", "2.5", "4.1")}
    assert vals["0.5"] < 2 and vals["1.3"] < 2
    assert vals["2.5"] >= 2 and vals["4.1"] >= 2
    for q in ("0.5", "1.3"):
        assert _whole(_import(tmp_path, q)).value("arrivals_over_completions") < 1.25


# -- class 2: prefix-cache hits and misses are not queueing ------------------------------------

@pytest.mark.parametrize("qps", ["0.5", "1.3"])
def test_hit_miss_split_is_not_queueing(tmp_path, qps):
    """Every prompt is the same 21,073 tokens; TTFT is ~0.05 s (cache hit) or ~2.97 s (the whole
    prefill), with several requests in flight. Not CRITICAL queueing: prefix reuse, with numbers."""
    diag = diagnose(_import(tmp_path, qps))
    causes = _causes(diag)
    assert "queueing-saturation" not in causes
    hm = causes["prefix-cache-hit-miss"]
    raw = _raw(qps)
    # the raw file's hits: under half the unloaded prefill (QPS 0.1's median TTFT, the same prompt)
    fast = raw["ttft"] < 0.5 * np.median(_raw("0.1")["ttft"])
    assert np.median(raw["ttft"][fast]) < 0.1 and raw["ttft"][~fast].min() > 1.0
    assert hm.evidence["ttft_fast_mode_frac"] == pytest.approx(fast.mean(), abs=1e-9)
    assert hm.evidence["ttft_fast_mode_p50_s"] == pytest.approx(np.median(raw["ttft"][fast]))
    assert hm.evidence["ttft_slow_mode_p50_s"] == pytest.approx(np.median(raw["ttft"][~fast]))
    # the slow mode is the prompt's own prefill cost at low load, not waiting
    assert 0.7 <= hm.evidence["ttft_slow_mode_over_prefill"] <= 1.3


def test_hits_that_waited_still_count_as_hits(tmp_path):
    """QPS 2.1: some cache hits waited behind another request's 21k-token prefill (TTFT 0.28-2.47 s),
    filling the gap between the clusters; each TTFT judged against its own prompt's prefill cost
    (a miss cannot prefill faster than the unloaded server) still finds the split, with the misses
    at about their prefill cost."""
    hm = _causes(diagnose(_import(tmp_path, "2.1")))["prefix-cache-hit-miss"]
    raw = _raw("2.1")
    assert np.exp(np.diff(np.log(np.sort(raw["ttft"]))).max()) < 4  # no empty 4x gap in the raw file
    assert 0.03 <= hm.evidence["ttft_fast_mode_frac"] <= 0.15
    assert 0.7 <= hm.evidence["ttft_slow_mode_over_prefill"] <= 1.5


@pytest.mark.parametrize("hit_share, fires", [("split", True), (0.95, False)])
def test_the_engines_hit_counters_must_fit_the_split(tmp_path, hit_share, fires):
    """Where no request says what it had cached, the engine's prefix-cache counters must fit a
    hit/miss split: a miss has under half its prompt cached. Seen on real vLLM (CPU, multi-turn,
    once in 12 full runs): six conversations' next turns arrived together and the later ones waited
    behind the earlier ones' prefill in the same batch, 75% of requests in the slow TTFT cluster
    while the engine counted 75% of prompt tokens cached. Here the AIBrix hit/miss run (the same
    21k-token prompt throughout) with counters that match its split still fires; with counters
    saying 95% of tokens were cached, its slow requests must have hit too, and it does not."""
    cap = _import(tmp_path, "0.5")
    f = _whole(cap).value("ttft_fast_mode_frac")
    share = f if hit_share == "split" else hit_share
    recs = request_records(cap)
    t0 = min(r.arrival_s for r in recs) - 1
    t1 = max(r.finish_s for r in recs) + 1
    prompt_per_s = sum(r.prompt_tokens for r in recs) / (t1 - t0)
    engine = [EngineSample(time_s=t, engine="vllm", values={"prefix_cache_queries_total": (t - t0) * prompt_per_s,
                                                            "prefix_cache_hits_total": share * (t - t0) * prompt_per_s})
              for t in np.arange(t0, t1 + 5, 5.0)]
    counted = from_records(cap.meta, requests=recs, engine=engine)
    assert _whole(counted).value("prefix_hit_rate_achieved") == pytest.approx(share, rel=0.01)
    assert ("prefix-cache-hit-miss" in _causes(diagnose(counted))) is fires
    assert _whole(counted).value("ttft_cache_bimodal") == float(fires)


def test_queue_after_a_slow_start_is_not_hit_miss():
    """samples/vllm-saturation (real vLLM, 4 slots, arrivals above capacity) with its first three
    requests held 30 s, as an engine that stalls at start (a cold compile, a CPU starved by its
    neighbours: CI once measured a 2.45 s low-load TTFT on this scenario) holds them. The
    low-load prefill speed then has waiting in it, and queued requests sit near that cost like
    misses, beside a cluster that came before the queue grew. Hits and misses do not depend on
    the load a request meets: the slow cluster met a server twice as busy, so it waited."""
    cap = kvdoctor.load(SAMPLES / "vllm-saturation")
    recs = sorted(request_records(cap), key=lambda r: r.arrival_s)
    held = [derive_request(dataclasses.replace(r, first_token_s=r.first_token_s + 30, finish_s=r.finish_s + 30,
                                               ttft_s=None, e2e_s=None)) if i < 3 else r for i, r in enumerate(recs)]
    slow_start = from_records(cap.meta, requests=held)
    w = _whole(slow_start)
    assert w.value("ttft_slow_mode_over_prefill") <= 2.0  # queued requests near the (inflated) prefill cost
    assert w.value("ttft_cache_bimodal") == 0
    causes = _causes(diagnose(slow_start))
    assert "prefix-cache-hit-miss" not in causes and "queueing-saturation" in causes


def test_a_split_both_sides_cached_is_not_hit_miss():
    """samples/concurrency (llama-server, 43-token prompts, 4 in flight): TTFT is 0.04 s or 0.26 s,
    but llama-server reports ~77% of prompt tokens cached on both sides: the slow side waited for a
    decode step, it did not miss the cache."""
    w = _whole(kvdoctor.load(SAMPLES / "concurrency"))
    assert w.value("ttft_fast_mode_frac") < 0.5 and w.value("ttft_cache_bimodal") == 0


def test_bimodal_ttft_from_prompt_lengths_is_not_cache():
    """A real llama-server with short and ~1,800-token prompts: TTFT is bimodal because the
    prompts are, which is prefill cost, not cache hits."""
    assert _whole(kvdoctor.load(SAMPLES / "long-prompts")).value("ttft_cache_bimodal") == 0


# -- class 3: bandwidth measured or estimated, else a hypothesis -------------------------------

def test_bandwidth_bound_estimate_for_llama8b_on_a100(tmp_path):
    """Weights (16 GB) + the KV of the batch that fits (about 20 x 21k tokens x 128 KiB) over
    2.04 TB/s: ~38 ms. TPOT 217-766 ms at QPS 2.5-4.1 is far above it: not bandwidth-bound."""
    for q in ("2.5", "4.1"):
        cap = _import(tmp_path, q)
        w = _whole(cap)
        assert 0.030 <= w.value("decode_bw_bound_tpot_s") <= 0.045
        assert w.value("tpot_over_bw_bound_p50") > 3
        assert "decode-bandwidth-bound" not in _causes(diagnose(cap))


def test_bandwidth_without_gpu_is_a_hypothesis(tmp_path):
    """The 1.3 QPS run judged by the bandwidth rule alone (decode-stall-tail, which it yields
    to here, left out): without the GPU named it may fire only as a low-confidence hypothesis
    that says bandwidth was neither measured nor estimated; with the GPU, as an estimate."""
    from kvdoctor.diagnosis import load_rules

    alone = [r for r in load_rules() if r.id != "decode-stall-tail"]
    c = _causes(diagnose(_import(tmp_path, "1.3", gpu=None), alone)).get("decode-bandwidth-bound")
    assert c is not None and c.confidence <= 0.4 and "neither measured" in c.cause
    with_gpu = _causes(diagnose(_import(tmp_path, "1.3"), alone))["decode-bandwidth-bound"]
    assert "estimated" in with_gpu.cause and with_gpu.confidence > c.confidence


def test_prefill_stalls_are_not_bandwidth(tmp_path):
    """1.3 QPS with every rule: TPOT rises with concurrency because 21k-token prefills stall the
    decode steps (decodes no prefill overlapped run at the unloaded 12.7 ms, tests/labels.yaml):
    decode-stall-tail names it and decode-bandwidth-bound yields, GPU named or not."""
    for gpu in ("A100-80GB", None):
        causes = _causes(diagnose(_import(tmp_path / str(gpu), "1.3", gpu=gpu)))
        assert "decode-stall-tail" in causes and "decode-bandwidth-bound" not in causes, (gpu, sorted(causes))


def test_cpu_server_is_a_hypothesis_to_measure_not_a_bandwidth_verdict():
    """llama.cpp on 2 CPU threads (samples/concurrency, no GPU): the labels call its TPOT growth
    compute-bound (tests/labels.yaml: far beyond what the bytes per step explain). Where
    decode-bandwidth-bound speaks there, it is a hypothesis: it names the CPU, stays at 50% or
    under, its first step is a measurement (never a KV-precision change), and it pages nobody."""
    diag = diagnose(kvdoctor.load(SAMPLES / "concurrency"))
    c = _causes(diag).get("decode-bandwidth-bound")
    # it fires there today (the corpus table's false positive): checked as what it says, not skipped
    assert c is not None, "decode-bandwidth-bound went silent on samples/concurrency: update the docs' table and this test"
    assert "CPU" in c.cause and c.confidence <= 0.5 and c.measure, c
    assert c.effective_severity == "info"


# -- class 4: a decode-stall tail ---------------------------------------------------------------

def test_decode_stall_tail_on_public_run(tmp_path):
    """QPS 0.5: TPOT P99 4.4x its median with TTFT at its low-load value; the slow decodes are
    the ones that overlapped other requests' 21k-token prefills. Was "No incident"."""
    cap = _import(tmp_path, "0.5")
    c = _causes(diagnose(cap))["decode-stall-tail"]
    assert c.cause.startswith("Prefills share decode steps")
    raw = _raw("0.5")
    tpot = raw["generation_time"] / (raw["generation_tokens"] - 1)
    assert c.evidence["tpot_p99_s"] / c.evidence["tpot_p50_s"] == pytest.approx(
        np.percentile(tpot, 99) / np.median(tpot), rel=1e-3)
    # ground truth for the mechanism, from the CSV: seconds of other requests' prefill (launch to
    # first token) inside each request's decode; the slowest quarter decoded beside far more
    first = raw["launch_time"] + raw["ttft"]
    overlap_s = np.array([np.sum(np.clip(np.minimum(first, e) - np.maximum(raw["launch_time"], f), 0, None))
                          for f, e in zip(first, raw["finish_time"])])
    slow = tpot >= np.percentile(tpot, 75)
    assert np.median(overlap_s[slow]) > 2 * np.median(overlap_s[~slow])


def test_no_decode_stall_on_real_runs_without_stalls():
    """Real llama.cpp runs whose decodes no prefill or neighbour stalls (the labels give none):
    decode-stall-tail was evaluated on them (60 and 116 requests, over its 50) and stays silent.
    (samples/healthy, 40 requests, is under its minimum: it could not fire there at all.)"""
    for name in ("multi-turn", "concurrency"):
        diag = diagnose(kvdoctor.load(SAMPLES / name))
        rule = next(r for r in diag.rules if r.id == "decode-stall-tail")
        assert could_fire(rule, diag) is None, name  # its gates pass on the windows diagnose evaluates
        assert "decode-stall-tail" not in _causes(diag), name


# -- class 6: a fit needs spread -----------------------------------------------------------------

def test_fit_over_a_narrow_range_is_unknown(tmp_path):
    """AIBrix 4.1: every prompt is 21,073 tokens and outputs differ by at most 100, so context
    varies by 0.5%: the TPOT-per-1k-context slope (-4,162 ms before) is unknown, not a number."""
    w = _whole(_import(tmp_path, "4.1"))
    assert np.isnan(w.value("tpot_context_slope_ms_per_1k_tokens"))
    assert np.isnan(w.value("tpot_context_corr"))
    x = np.linspace(1000, 1100, 50)
    assert np.isnan(fit(x, 2 * x, min_spread_frac=0.1)[0])
    x = np.linspace(100, 2000, 50)
    assert fit(x, 2 * x + 1, min_spread_frac=0.1)[0] == pytest.approx(2)


# -- class 9: real-server shapes ------------------------------------------------------------------

def test_one_conversation_at_a_time_is_kv_growth():
    """Recorded on a real llama-server (--parallel 2): two 12-turn conversations one after the
    other. Concurrency is 1; only the history grows."""
    cap = kvdoctor.load(SAMPLES / "one-conversation-at-a-time")
    w = _whole(cap)
    assert w.value("concurrency_max") <= 2  # the next turn may arrive as the last one's final chunk leaves
    diag = diagnose(cap)
    assert diag.incidents and diag.incidents[0].causes[0].rule.id == "kv-growth-per-turn"
    assert "decode-bandwidth-bound" not in _causes(diag)


def test_mixed_prompts_name_long_prefills_first():
    """Recorded on a real llama-server: 3 clients, 10-word and 900-1,400-word prompts, 2 slots.
    The long prefills holding the slots come first, not 'add replicas'."""
    diag = diagnose(kvdoctor.load(SAMPLES / "mixed-prompts-2-slots"))
    assert diag.incidents
    top = diag.incidents[0].causes[0].rule.id
    # prefill-decode-interference (issue 17) names the same long prefills, seen in the decode gaps
    # they stall (79% of decode time here); it may lead when its incident starts first
    assert top in ("long-prompt-hol-blocking", "prefill-bound", "prefill-decode-interference"), top


# -- the host, not the workload -----------------------------------------------------------------

def test_busy_host_is_named_as_the_host(tmp_path):
    """samples/busy-host: the healthy load on a real llama-server while two busy loops take the
    host's 2 cores. The stalls are blamed on the host, with the other processes' share measured
    from the capture's own psutil samples (host busy share - server cores / CPUs), and the first
    fix is the host's CPU, not chunked prefill or disaggregation."""
    cap = kvdoctor.load(SAMPLES / "busy-host")
    host = cap.host
    busy, server, count = host.num("host_cpu_frac"), host.num("server_cpu_cores"), host.num("host_cpu_count")
    other = np.nanmedian(busy - server / count)
    [c] = [c for inc in diagnose(cap).incidents for c in inc.causes if c.rule.id == "decode-stall-tail"]
    assert "host" in c.cause and c.evidence["host_other_cpu_frac"] == pytest.approx(other)
    assert other >= 0.25 and c.fixes[0].title.startswith("Give the engine's host process its CPU")
    # the same load without the busy loops: nothing to blame
    quiet = _whole(kvdoctor.load(SAMPLES / "healthy"))
    assert not quiet.value("host_other_cpu_frac") >= 0.25  # NaN (recorded before the CPU count) or low


def test_trends_leave_out_requests_the_host_slowed():
    """Requests that ran while other processes held the host (samples/busy-host: two busy loops
    throughout) are marked contended and left out of per-turn latency trends; a capture without
    the host's CPU count (samples/healthy, recorded before it) marks none."""
    from kvdoctor.signals.host import contended

    busy = _whole(kvdoctor.load(SAMPLES / "busy-host"))
    assert contended(busy).mean() > 0.9
    assert not contended(_whole(kvdoctor.load(SAMPLES / "healthy"))).any()
    # and the diagnosis says so: a trend rule that stays quiet on such a capture is not a verdict
    said = [x for x in diagnose(kvdoctor.load(SAMPLES / "busy-host")).warnings if "other processes held" in x]
    assert said == [f"{int(contended(busy).sum())} of {busy.n_requests} requests ran while other processes held at "
                    "least 25% of the host's CPUs: trends through the run (growth per turn) leave them out, since "
                    "contention only adds time"]
    assert not [x for x in diagnose(kvdoctor.load(SAMPLES / "healthy")).warnings if "other processes" in x]
