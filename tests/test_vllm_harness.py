"""The vLLM harness's command line and the scenario mapping, without starting vLLM
(tests/test_vllm.py runs the real server)."""
import sys

import pytest

from harness import scenarios as S
from harness.vllm_server import KV_TOKENS_RE, VllmServer


def server(tmp_path, **kw):
    return VllmServer(python=sys.executable, model=tmp_path, **kw)


def test_cmdline_and_env(tmp_path):
    s = server(tmp_path, max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=9, prefix_caching=False,
               otlp_endpoint="http://127.0.0.1:4318/v1/traces", otlp_protocol="http/protobuf")
    cmd = s.cmdline()
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(cmd)
    for want in ("--max-model-len 512", "--max-num-seqs 8", "--num-gpu-blocks-override 9", "--no-enable-prefix-caching",
                 f"--host 127.0.0.1 --port {s.port}", "--otlp-traces-endpoint http://127.0.0.1:4318/v1/traces",
                 "--served-model-name smollm2 default"):
        assert want in flags, want
    # the same 11,648 tokens of KV in either dtype
    for dtype, kv in (("bfloat16", "256M"), ("float32", "512M")):
        flags = " ".join(server(tmp_path, dtype=dtype).cmdline())
        assert f"--dtype {dtype}" in flags and f"--kv-cache-memory-bytes {kv}" in flags, flags
    assert "--kv-cache-memory-bytes 1G" in " ".join(server(tmp_path, dtype="float32", kv_cache_bytes="1G").cmdline())
    env = s.env()
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf" and env["HF_HUB_OFFLINE"] == "1"
    plain = server(tmp_path)
    assert "--enable-prefix-caching" in plain.cmdline() and "--otlp-traces-endpoint" not in plain.cmdline()
    assert "OTEL_BSP_SCHEDULE_DELAY" not in plain.env()


def test_refuses_non_loopback_and_unknown_protocol(tmp_path):
    with pytest.raises(ValueError, match="loopback"):
        server(tmp_path, host="0.0.0.0")
    with pytest.raises(ValueError, match="otlp_protocol"):
        server(tmp_path, otlp_protocol="zipkin")


def test_kv_capacity_line_of_the_start_up_log():
    line = ("(EngineCore pid=16171) INFO 11-30 23:55:18 [kv_cache_utils.py:2327] CPU KV cache size: 11,648 tokens, "
            "Maximum concurrency for 2,048 tokens per request: 5.69x")
    assert KV_TOKENS_RE.findall(line) == ["11,648"]


def test_scenarios_map_to_vllm_settings():
    # a llama.cpp context shared by slots becomes a per-request length and a batch size
    assert S.vllm_options(S.SCENARIOS["healthy"]) == {"max_model_len": 2048, "max_num_seqs": 2}
    # scenarios that share a server in tests/test_vllm.py share its settings
    main = {n for n, sc in S.SCENARIOS.items() if S.vllm_options(sc) == S.VLLM_MAIN}
    assert {"prefix-cache-on", "saturation", "multi-turn"} <= main
    assert S.vllm_options(S.SCENARIOS["preemption"]) == S.vllm_options(S.SCENARIOS["context-overflow"]) == S.VLLM_TINY_KV
    assert S.engine_config(S.SCENARIOS["saturation"], "vllm")["max_running_requests"] == 4
    assert "max_running_requests" not in S.engine_config(S.SCENARIOS["saturation"], "llamacpp")
    with pytest.raises(ValueError, match="engine"):
        S.make_server(S.SCENARIOS["healthy"], "sglang")


SAMPLES = __import__("pathlib").Path(__file__).resolve().parents[1] / "samples"


@pytest.mark.parametrize("name", ["preemption", "prefix-cache-off", "prefix-cache-on", "saturation",
                                  "context-overflow", "multi-turn"])
def test_recorded_vllm_samples_name_their_cause(name):
    """The captures recorded on real vLLM (samples/vllm-*) keep naming what they were recorded for."""
    import kvdoctor
    from kvdoctor.diagnosis import diagnose

    from conftest import cause_tops, pages

    diag = diagnose(kvdoctor.load(SAMPLES / f"vllm-{name}"))
    tops = cause_tops(diag)
    expect = S.SCENARIOS[name].expect
    assert (expect in tops) if expect else not pages(diag), tops


def test_traceparent_trace_id():
    from kvdoctor.collect.proxy import traceparent_trace_id

    tid = "0af7651916cd43dd8448eb211c80319c"
    assert traceparent_trace_id(f"00-{tid}-b7ad6b7169203331-01") == tid
    for bad in (None, "", "garbage", f"ff-{tid}-b7ad6b7169203331-01", f"00-{'0' * 32}-b7ad6b7169203331-01",
                f"00-{tid.upper()}-b7ad6b7169203331-01", f"00-{tid}-b7ad6b71692033-01"):
        assert traceparent_trace_id(bad) is None, bad


def test_vllm_dtype_follows_the_cpu():
    """bfloat16 only where the CPU computes it natively: on an AVX2-only EPYC vLLM's bf16 linear
    falls back to a slow torch path (a 1,200-token prompt took seconds more to prefill)."""
    from harness.vllm_server import cpu_dtype

    assert cpu_dtype({"fpu", "sse", "avx2", "fma"}) == "float32"
    assert cpu_dtype({"fpu", "avx2", "avx512f", "avx512_bf16"}) == "bfloat16"
    assert cpu_dtype({"fpu", "avx2", "amx_bf16", "amx_tile"}) == "bfloat16"
    assert cpu_dtype(set()) == "float32"
