"""kvdoctor plan: the KV memory model, the tables, the planner, the live forecasts and the CLI."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvdoctor.cli import cli
from kvdoctor.errors import InputError
from kvdoctor.model import CaptureMeta, RequestRecord
from kvdoctor.plan import kvmodel as km
from kvdoctor.plan.forecast import forecast_kv_full, unsafe_concurrency
from kvdoctor.plan.models import builtin_model, gpu_memory, nvml_gpu, parse_bytes, resolve_model
from kvdoctor.plan.planner import PlanInputs, plan

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
GiB, MiB = 2**30, 2**20
FP16, BF16, FP8 = km.KV_DTYPES["fp16"], km.KV_DTYPES["bf16"], km.KV_DTYPES["fp8"]
GQA_7B = km.ModelSpec("7B-GQA", num_layers=32, num_attention_heads=32, kv_heads=8, head_dim=128)


def run(*args):
    return CliRunner().invoke(cli, ["plan", *args], catch_exceptions=False)


# -- the KV memory model ---------------------------------------------------------------------
@pytest.mark.parametrize("length, expected", [(4096, 512 * MiB), (32768, 4 * GiB), (131072, 16 * GiB)])
def test_7b_gqa_fp16_per_sequence(length, expected):
    assert km.kv_bytes_per_token(GQA_7B, FP16) == 131072
    assert km.kv_bytes_per_sequence(GQA_7B, FP16, length) == expected


def test_7b_gqa_16_sequences_of_128k_is_256_gib():
    assert 16 * km.kv_bytes_per_sequence(GQA_7B, FP16, 131072) == 256 * GiB


def test_opt_13b_fp16_is_800_kb_per_token():
    spec = builtin_model("facebook/opt-13b")
    assert spec.attention == "MHA"
    assert km.kv_bytes_per_token(spec, FP16) == 819_200


def test_mha_gqa_mqa_scale_with_kv_heads():
    import dataclasses
    mha = dataclasses.replace(GQA_7B, kv_heads=32)
    mqa = dataclasses.replace(GQA_7B, kv_heads=1)
    assert (mha.attention, GQA_7B.attention, mqa.attention) == ("MHA", "GQA", "MQA")
    assert km.kv_bytes_per_token(mha, FP16) == 4 * km.kv_bytes_per_token(GQA_7B, FP16) == 32 * km.kv_bytes_per_token(mqa, FP16)


def test_mla_is_one_latent_tensor_and_replicated_across_tp():
    spec = builtin_model("deepseek-ai/DeepSeek-V3")
    assert spec.attention == "MLA"
    assert km.kv_bytes_per_token(spec, BF16) == 61 * (512 + 64) * 2 == 70_272
    assert km.kv_bytes_per_token(spec, BF16, tp=8) == 70_272  # latent is not split by TP
    kimi = resolve_model(str(CONFIGS / "Kimi-K2-Instruct.json"))
    assert kimi.attention == "MLA" and km.kv_bytes_per_token(kimi, BF16) == 70_272


def test_paging_rounds_up_to_whole_blocks():
    per_token = km.kv_bytes_per_token(GQA_7B, FP16)
    assert km.kv_bytes_per_sequence(GQA_7B, FP16, 1) == 16 * per_token
    assert km.kv_bytes_per_sequence(GQA_7B, FP16, 17) == 32 * per_token
    assert km.kv_bytes_per_sequence(GQA_7B, FP16, 17, block_size_tokens=1) == 17 * per_token


def test_kv_dtypes_and_scale_overhead():
    assert km.kv_bytes_per_token(GQA_7B, FP8) == km.kv_bytes_per_token(GQA_7B, FP16) / 2
    assert km.kv_bytes_per_token(GQA_7B, km.KV_DTYPES["fp32"]) == 2 * km.kv_bytes_per_token(GQA_7B, FP16)
    # int8/int4: + fp16 scale and zero point per token, head and tensor
    assert km.kv_bytes_per_token(GQA_7B, km.KV_DTYPES["int8"]) == 32 * 8 * 2 * (128 + 4)
    assert km.kv_bytes_per_token(GQA_7B, km.KV_DTYPES["int4"]) == 32 * 8 * 2 * (64 + 4)
    assert km.kv_dtype("float8").name == "fp8"
    with pytest.raises(InputError, match="--kv-dtype"):
        km.kv_dtype("fp6")


def test_tensor_parallel_splits_kv_heads_and_replicates_past_them():
    q = builtin_model("Qwen3-235B-A22B")  # 4 KV heads
    assert km.kv_bytes_per_token(q, BF16, tp=4) == km.kv_bytes_per_token(q, BF16) / 4
    assert km.kv_bytes_per_token(q, BF16, tp=8) == km.kv_bytes_per_token(q, BF16, tp=4)  # 1 head each, replicated


def test_sliding_window_layers_capped_at_their_window():
    oss = resolve_model(str(CONFIGS / "gpt-oss-20b.json"))
    assert (oss.sliding_layers, oss.sliding_window_tokens, oss.kv_heads, oss.head_dim) == (12, 128, 8, 64)
    per_layer = 2 * 8 * 64 * 2
    assert km.kv_bytes_per_sequence(oss, BF16, 131072) == 12 * 131072 * per_layer + 12 * 128 * per_layer
    assert km.kv_bytes_per_sequence(oss, BF16, 100) == 24 * 112 * per_layer  # under the window: no cap
    assert builtin_model("gemma-2-9b").sliding_layers == 21  # Gemma 2: every other layer
    g3 = builtin_model("google/gemma-3-27b-it")  # Gemma 3: 5 local : 1 global
    assert (g3.sliding_layers, g3.sliding_window_tokens) == (52, 1024)
    assert builtin_model("mistralai/Mistral-7B-v0.1").sliding_layers == 32


def test_hf_config_gqa_and_estimated_parameters():
    spec = resolve_model(str(CONFIGS / "Llama-3.3-70B-Instruct.json"))
    assert (spec.num_layers, spec.kv_heads, spec.head_dim, spec.attention) == (80, 8, 128, "GQA")
    assert km.kv_bytes_per_token(spec, BF16) == 327_680
    assert spec.params == pytest.approx(70.55e9, rel=0.01)
    assert spec.sliding_layers == 0 and spec.max_position_embeddings == 131072


def test_hf_config_folder_and_gemma3_text_config(tmp_path):
    cfg = {"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 62,
           "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024,
           "sliding_window_pattern": 6, "hidden_size": 5376}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))
    assert (spec.num_layers, spec.sliding_layers, spec.kv_heads) == (62, 52, 16)


@pytest.mark.parametrize("cfg, field", [
    ({"num_attention_heads": 32}, "num_hidden_layers"),
    ({"num_hidden_layers": 32}, "num_attention_heads"),
    ({"num_hidden_layers": 32, "num_attention_heads": 32}, "head_dim"),
    ({"num_hidden_layers": "32", "num_attention_heads": 32, "head_dim": 128}, "num_hidden_layers"),
])
def test_hf_config_missing_fields_name_the_field(tmp_path, cfg, field):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=f"config.json: field {field}"):
        resolve_model(str(path))


def test_bad_inputs_are_input_errors(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="bad.json: not a readable JSON"):
        resolve_model(str(tmp_path / "bad.json"))
    with pytest.raises(InputError, match="did you mean"):
        resolve_model("Llama-3.1-8")
    with pytest.raises(InputError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(InputError, match="--gpu-mem: cannot read '80 potatoes'"):
        parse_bytes("80 potatoes", "--gpu-mem")
    with pytest.raises(InputError, match="A100-40GB or A100-80GB"):
        gpu_memory("A100")


def test_sizes_and_gpu_names():
    assert parse_bytes("80GiB", "x") == 80 * GiB and parse_bytes("80GB", "x") == 80e9
    assert parse_bytes("24576MiB", "x") == 24 * GiB and parse_bytes("1.5G", "x") == 1.5 * GiB
    assert gpu_memory("NVIDIA H100") == ("H100-80GB", 81559 * MiB)
    assert gpu_memory("h200")[1] == 143771 * MiB and gpu_memory("a100-40gb")[1] == 40 * GiB
    assert gpu_memory("80GiB") is None
    for name in ("L4", "A10G", "T4", "L40S", "MI300X", "RTX 4090", "A100-80GB"):
        assert gpu_memory(name) is not None


def test_nvml_is_optional(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert nvml_gpu() is None

    class Fake:
        def nvmlInit(self): pass
        def nvmlShutdown(self): pass
        def nvmlDeviceGetHandleByIndex(self, i): return i
        def nvmlDeviceGetName(self, h): return b"NVIDIA L4"
        def nvmlDeviceGetMemoryInfo(self, h): return type("M", (), {"total": 23034 * MiB})()

    monkeypatch.setitem(sys.modules, "pynvml", Fake())
    assert nvml_gpu() == ("NVIDIA L4", 23034 * MiB)


# -- capacity: kvdoctor's figure against the figures engines print at startup ----------------
# Each row: a published configuration, the engine's printed KV size in tokens, and the inputs
# that fully determine it. See docs/plan.md for what each input means and when it differs.
ENGINE_FIGURES = [
    pytest.param(  # vLLM (V0): "# GPU blocks: 1952" = 31,232 tokens; "Maximum concurrency for 20000 tokens: 1.56x"
        "Llama-3.1-8B", "bf16", 16, dict(gpu_mem_bytes=23.58 * GiB, mem_util_frac=0.90, weight_bytes=14.9888 * GiB,
                                         reserve_bytes=(17.06 - 14.9888 + 0.35) * GiB),
        31_232, (20000, 1.56), id="vllm-10517-llama3.1-8b-rtx3090-20k"),
    pytest.param(  # same GPU, --max-model-len 29000: 1478 blocks = 23,648 tokens, 0.82x
        "Llama-3.1-8B", "bf16", 16, dict(gpu_mem_bytes=23.58 * GiB, mem_util_frac=0.90, weight_bytes=14.9888 * GiB,
                                         reserve_bytes=(17.98 - 14.9888 + 0.35) * GiB),
        23_648, (29000, 0.82), id="vllm-10517-llama3.1-8b-rtx3090-29k"),
    pytest.param(  # vLLM (V1): "Available KV cache memory: 6.51 GiB", "GPU KV cache size: 42,656 tokens", 1.30x
        "Qwen3-14B", "bf16", 16, dict(gpu_mem_bytes=0, kv_mem_override_bytes=6.51 * GiB),
        42_656, (32768, 1.30), id="lmcache-1739-qwen3-14b-vllm"),
    pytest.param(  # vLLM (V1) TP4: "Available KV cache memory: 8.11 GiB", "GPU KV cache size: 178,880 tokens"
        "Qwen3-235B-A22B", "bf16", 16, dict(gpu_mem_bytes=0, tp=4, kv_mem_override_bytes=8.11 * GiB),
        178_880, None, id="vllm-21348-qwen3-235b-fp8-tp4"),
    pytest.param(  # SGLang TP4, page 1: "KV Cache is allocated. #tokens: 367404, K size: 8.23 GB, V size: 8.23 GB"
        "Qwen3-235B-A22B", "bf16", 1, dict(gpu_mem_bytes=0, tp=4, kv_mem_override_bytes=(8.23 + 8.23) * GiB),
        367_404, None, id="sglang-21348-qwen3-235b-fp8-tp4"),
]


@pytest.mark.parametrize("model, dtype, block, budget, engine_tokens, concurrency", ENGINE_FIGURES)
def test_capacity_matches_engine_startup_figures(model, dtype, block, budget, engine_tokens, concurrency):
    spec, kvd = builtin_model(model), km.KV_DTYPES[dtype]
    b = km.GpuBudget(**budget)
    ours = km.max_kv_tokens(spec, kvd, b, block_size_tokens=block)
    assert abs(ours - engine_tokens) / engine_tokens <= 0.02, (ours, engine_tokens)
    if concurrency:
        length, engine_x = concurrency
        assert km.max_concurrency(spec, kvd, b, length, block) == pytest.approx(engine_x, abs=0.01)


def test_gpu_budget_arithmetic_and_safe_concurrency():
    b = km.GpuBudget(gpu_mem_bytes=80 * GiB, mem_util_frac=0.9, weight_bytes=16 * GiB, reserve_bytes=2 * GiB)
    assert b.kv_budget_bytes_per_gpu == 54 * GiB
    assert km.max_kv_tokens(GQA_7B, FP16, b) == 54 * GiB // (128 * 1024 * 16) * 16 == 442_368
    assert km.max_concurrency(GQA_7B, FP16, b, 32768) == pytest.approx(13.5)
    assert km.safe_concurrency(GQA_7B, FP16, b, 32768) == 10  # floor(13.5 * 0.8)
    tp2 = km.GpuBudget(gpu_mem_bytes=80 * GiB, tp=2, weight_bytes=16 * GiB, reserve_bytes=2 * GiB)
    assert km.max_kv_tokens(GQA_7B, FP16, tp2) > 2 * km.max_kv_tokens(GQA_7B, FP16, b)


# -- the planner -----------------------------------------------------------------------------
def _inputs(**kw):
    b = km.GpuBudget(gpu_mem_bytes=80 * GiB, weight_bytes=16 * GiB, reserve_bytes=2 * GiB)
    return PlanInputs(**{"spec": GQA_7B, "max_len_tokens": 32768, "kv_dtype": FP16, "budget": b, **kw})


def test_plan_fields_and_levers_in_order():
    p = plan(_inputs(concurrency=16))
    assert p["kv_bytes_per_token"] == 131072 and p["kv_bytes_per_sequence"] == 4 * GiB
    assert (p["max_kv_tokens"], p["safe_concurrency"]) == (442_368, 10)
    assert [lv["lever"] for lv in p["levers"]] == ["lower-concurrency", "kv-quantisation", "sliding-window",
                                                   "attention-variant"]
    conc, quant, sw, att = p["levers"]
    assert conc["fits"] is False and conc["kv_bytes_needed_per_gpu"] == 64 * GiB
    assert quant["kv_dtype"] == "fp8" and quant["kv_bytes_per_token"] == 65536 and quant["safe_concurrency"] == 21
    assert sw["already"] is False and sw["safe_concurrency"] > quant["safe_concurrency"]
    by = {v["attention"]: v for v in att["variants"]}
    assert by["MHA"]["kv_bytes_per_token"] == 4 * by["GQA-8"]["kv_bytes_per_token"] == 32 * by["MQA"]["kv_bytes_per_token"]
    assert by["GQA-8"]["current"] and not by["MHA"]["current"]


def test_plan_without_gpu_still_answers_per_token_and_sequence():
    p = plan(_inputs(budget=None))
    assert p["kv_bytes_per_sequence"] == 4 * GiB and p["max_kv_tokens"] is None and p["safe_concurrency"] is None


def _capture(tmp_path, lengths, config=None):
    from kvdoctor.capture import CaptureWriter
    with CaptureWriter(tmp_path / "cap", CaptureMeta(created_unix_s=0.0, config=config or {})) as w:
        for i, n in enumerate(lengths):
            w.write(RequestRecord(request_id=str(i), arrival_s=float(i), prompt_tokens=int(n) - 100, output_tokens=100))
    return tmp_path / "cap"


def test_plan_uses_capture_p95_p99_not_mean(tmp_path):
    lengths = [1000] * 90 + [20000] * 10  # mean 2,900; P95/P99 20,000
    cap = _capture(tmp_path, lengths, {"max_num_seqs": 64})
    from kvdoctor.plan.planner import capture_lengths
    c = capture_lengths(str(cap))
    assert (c["p95_len_tokens"], c["p99_len_tokens"], c["requests"], c["max_concurrency"]) == (20000, 20000, 100, 64)
    p = plan(_inputs(capture=c))
    assert p["capture"]["safe_concurrency_p99"] == km.safe_concurrency(GQA_7B, FP16, _inputs().budget, 20000)
    assert p["capture"]["unsafe_concurrency"]["unsafe"] is True  # 64 x 20,000 tokens > 80% of 442,368


def test_capture_without_lengths_is_an_input_error(tmp_path):
    from kvdoctor.capture import CaptureWriter
    from kvdoctor.plan.planner import capture_lengths
    with CaptureWriter(tmp_path / "cap") as w:
        w.write(RequestRecord(request_id="a", arrival_s=1.0))
    with pytest.raises(InputError, match="prompt_tokens"):
        capture_lengths(str(tmp_path / "cap"))


# -- live forecasts --------------------------------------------------------------------------
def test_forecast_linear_growth():
    t = np.arange(0, 601, 10.0)
    u = 0.5 + 0.02 * t / 60  # +2 points a minute, 0.70 now
    assert forecast_kv_full(t, u) == pytest.approx(15.0, rel=1e-6)


def test_forecast_is_robust_to_spikes_and_ignores_nan():
    t = np.arange(0, 601, 10.0)
    u = 0.5 + 0.02 * t / 60
    u[[5, 17, 30]] = [0.99, 0.05, np.nan]
    assert forecast_kv_full(t, u) == pytest.approx(15.0, rel=0.05)


def test_forecast_none_when_flat_falling_or_too_short_and_zero_when_full():
    t = np.arange(0, 600, 10.0)
    assert forecast_kv_full(t, np.full(len(t), 0.6)) is None
    assert forecast_kv_full(t, 0.9 - 0.001 * t) is None
    assert forecast_kv_full([0, 10], [0.1, 0.2]) is None
    assert forecast_kv_full(t, np.linspace(0.5, 1.0, len(t))) == 0.0
    assert forecast_kv_full([], []) is None


def test_forecast_uses_recent_window_only():
    t = np.arange(0, 3601, 10.0)
    u = np.where(t < 3000, 0.9 - 0.8 * t / 3000, 0.1 + 0.03 * (t - 3000) / 60)  # fell, now rising 3 pts/min
    assert forecast_kv_full(t, u, window_s=600) == pytest.approx((1 - 0.4) / 0.03, rel=0.01)


def test_forecast_full_now_when_requests_wait_for_blocks():
    t = np.arange(0, 60, 1.0)
    u = np.full(len(t), 0.875)  # flat below 100%: usage alone says "not growing"
    assert forecast_kv_full(t, u) is None
    waiting = np.full(len(t), 5.0)
    # one more sequence needs 4 of 9 blocks (0.44); 0.125 free: nobody can be admitted
    assert forecast_kv_full(t, u, waiting=waiting, admit_frac=4 / 9) == 0.0
    # the same usage with room for one more sequence, or nobody waiting: not full
    assert forecast_kv_full(t, u, waiting=waiting, admit_frac=0.1) is None
    assert forecast_kv_full(t, u, waiting=np.where(t < 59, 5.0, 0.0), admit_frac=4 / 9) is None
    # unknown need (NaN): usage alone decides
    assert forecast_kv_full(t, u, waiting=waiting, admit_frac=float("nan")) is None
    with pytest.raises(ValueError, match="waiting"):
        forecast_kv_full(t, u, waiting=waiting[:3], admit_frac=0.4)


def test_forecast_on_the_real_vllm_preemption_run():
    """vLLM 0.32, 9 blocks of 128 tokens, 8 sequences of 188 + 256 tokens: the sidecar's windows
    (every 5 s, 300 s back). While requests wait for capacity the cache is full for admission,
    though block-granular usage sways between 75% and 100%; the preemption counter only moves
    when a preempted request resumes. Usage alone gave a forecast in 1 window of 11."""
    from kvdoctor import load
    from kvdoctor.signals import Prepared

    cap = load(Path(__file__).parent.parent / "samples" / "vllm-preemption")
    prep = Prepared(cap)
    t = prep.engine_t
    waiting, usage = cap.engine.get("requests_waiting_capacity"), cap.engine.get("kv_usage_frac")
    full_now = usage_only = steps_waiting = 0
    for now in np.arange(prep.start_s + 5, prep.end_s + 5, 5.0):
        w = prep.window(now - 300, now)
        last = np.flatnonzero(t <= now)[-1]
        minutes = w.value("kv_full_forecast_min")
        if waiting[last] > 0:
            steps_waiting += 1
            assert minutes == 0, (now - prep.start_s, usage[last], waiting[last])
            full_now += 1
            usage_only += forecast_kv_full(t[: last + 1], usage[: last + 1], window_s=300) is not None
        elif usage[last] == 0:
            assert np.isnan(minutes)  # drained: nothing to forecast
    assert steps_waiting >= 8 and full_now == steps_waiting
    assert usage_only <= steps_waiting // 2  # what the fix changed: usage alone rarely read "full"
    # the first time requests wait with usage below 100%: full now, with one median sequence's blocks
    last = np.flatnonzero((waiting > 0) & (usage < 1))[0]
    tokens = cap.requests.num("prompt_tokens") + cap.requests.num("output_tokens")
    admit = np.ceil(np.median(tokens) / 128) * 128 / cap.meta.config["kv_capacity_tokens"]
    assert forecast_kv_full(t[: last + 1], usage[: last + 1], waiting=waiting[: last + 1], admit_frac=admit) == 0.0, \
        (usage[last], admit)
    print(f"usage alone forecast {usage_only} of {steps_waiting} windows with requests waiting")


def test_unsafe_concurrency_numbers():
    check = unsafe_concurrency(64, 8000, 400_000)
    assert check and check.unsafe and check.needed_tokens == 512_000 and check.usable_tokens == 320_000
    assert check.safe_concurrency == 40
    ok = unsafe_concurrency(32, 8000, 400_000)
    assert not ok and "fits" in ok.message()


# -- CLI ---------------------------------------------------------------------------------------
def test_cli_help_has_examples():
    r = run("--help")
    assert r.exit_code == 0 and "Examples:" in r.output and "--from-capture" in r.output


def test_cli_text():
    r = run("--model", "Llama-3.1-8B", "--max-len", "32768", "--gpu-mem", "H100", "--concurrency", "16")
    assert r.exit_code == 0, r.output
    assert "131,072 B" in r.output and "4.00 GiB" in r.output and "Levers, in order:" in r.output
    assert "KV fp8" in r.output and "MHA" in r.output and "MQA" in r.output


def test_cli_json_fields(tmp_path):
    cap = _capture(tmp_path, [1000] * 95 + [8000] * 5)
    r = run("--model", str(CONFIGS / "Llama-3.3-70B-Instruct.json"), "--max-len", "8192", "--gpu-mem", "80GiB",
            "--tp", "4", "--kv-dtype", "fp8", "--from-capture", str(cap), "--format", "json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    for k in ("kv_bytes_per_token", "kv_bytes_per_sequence", "max_kv_tokens", "safe_concurrency"):
        assert p[k] is not None
    assert p["kv_bytes_per_token"] == 163_840 and p["kv_bytes_per_token_per_gpu"] == 40_960
    assert p["capture"]["p99_len_tokens"] == 8000 and p["gpu"]["tp"] == 4


def test_cli_kv_mem_reproduces_an_engine_log():
    r = run("--model", "Qwen3-14B", "--max-len", "32768", "--kv-mem", "6.51GiB", "--format", "json")
    p = json.loads(r.output)
    assert p["max_kv_tokens"] == 42_656 and round(p["max_concurrency"], 2) == 1.30


@pytest.mark.parametrize("args, msg", [
    (["--model", "NoSuchModel-7B", "--max-len", "4096"], "--model: 'NoSuchModel-7B'"),
    (["--model", "Llama-3.1-8B", "--max-len", "4096", "--gpu-mem", "lots"], "--gpu-mem 'lots': neither a size (80GiB, 80GB) nor a known GPU"),
    (["--model", "Llama-3.1-8B"], "--max-len: required"),
    (["--model", "Llama-3.1-70B", "--max-len", "4096", "--gpu-mem", "L4"], "leaves no room for the KV cache"),
])
def test_cli_bad_input_exits_2_with_one_line(args, msg):
    r = CliRunner().invoke(cli, ["plan", *args])
    assert r.exit_code == 2
    assert msg in r.output and r.output.strip().count("\n") == 0


def test_fp8_checkpoint_names_and_zero_reserve():
    spec = builtin_model("Qwen/Qwen3-235B-A22B-FP8")
    assert spec.weight_dtype == "fp8" and spec.kv_heads == 4
    assert parse_bytes("0", "--reserve") == 0.0
    r = run("--model", "Qwen3-8B", "--max-len", "4096", "--gpu-mem", "24GiB", "--reserve", "0")
    assert r.exit_code == 0 and "GPU of 24.00 GiB x TP 1" in r.output


def test_the_engines_kv_dtype_from_its_own_bytes_and_tokens():
    """vLLM's cache_dtype "auto" is the model's compute dtype: a float32 server holds half the
    tokens in the same bytes. Its own KV bytes over the tokens it reports say which dtype it ran."""
    spec = km.ModelSpec("smollm2-135m", num_layers=30, num_attention_heads=9, kv_heads=3, head_dim=64)
    assert km.dtype_from_capacity(spec, 268435456, 11648, default=BF16).name == "bf16"  # samples/vllm-*: vLLM's own figures
    assert km.dtype_from_capacity(spec, 268435456, 5760, default=BF16).name == "fp32"
    assert km.dtype_from_capacity(spec, 268435456, 11648).bytes_per_value == 2
    assert km.dtype_from_capacity(spec, 268435456, 9000) is None  # fits no dtype: the model's default stays
    assert km.dtype_from_capacity(spec, 0, 11648) is None


def test_plan_from_a_vllm_capture_sizes_with_the_kv_dtype_it_ran(tmp_path):
    """samples/vllm-saturation (bf16): the plan's capacity is the one vLLM logged; the same bytes
    holding half the tokens (a float32 server) plan in fp32, not the config's bfloat16."""
    # SmolLM2-135M-Instruct's config.json, the fields the KV model reads
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152,
           "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sample = Path(__file__).parents[1] / "samples" / "vllm-saturation"
    conf = json.loads((sample / "meta.json").read_text())["config"]
    r = run("--model", str(tmp_path / "config.json"), "--max-len", "2048", "--from-capture", str(sample), "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["max_kv_tokens"] == conf["kv_capacity_tokens"]
