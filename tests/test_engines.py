"""Engine tables, scrape parsing, rates and the prometheus importer, on real scrapes
(tests/data/metrics, see SOURCES.md there) and small inline ones in the servers' own format."""
from __future__ import annotations

import math
import os
from pathlib import Path

import orjson
import pytest

from kvdoctor.engines import (NEUTRAL, TABLES, counter_increase, counter_rate, histogram_quantile,
                              llamacpp_config_from_props, parse_scrape, window_quantiles)
from kvdoctor.engines.rates import histogram_delta
from kvdoctor.errors import InputError
from kvdoctor.importers import prometheus
from kvdoctor.model import EngineSample, Event, to_dict

DATA = Path(__file__).parent / "data" / "metrics"
VLLM_V0 = DATA / "vllm_v0_qwen2.5-coder-1.5b_aibrix_runtime_doc.prom"
SGL = DATA / "sglang_llama3.1-8b_production_metrics_doc.prom"
SGL_EARLY = DATA / "sglang_gemma-2-9b-it_production_metrics_doc_early.prom"
TRT = DATA / "trtllm_triton_backend_readme_metrics.prom"
DCGM = DATA / "datadog_dcgm_fixture_metrics.txt"

# as llama-server's get_metrics route writes it (tools/server/server-context.cpp)
LLAMACPP = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6886
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 2.903
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 3469
# HELP llamacpp:tokens_predicted_seconds_total Predict process time
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 35.44
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 3480
# HELP llamacpp:n_tokens_max Largest observed n_tokens.
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 1024
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
"""

# as metrics-exporter-prometheus writes TGI's counters (no _total on older exporter versions)
TGI = """# TYPE tgi_request_success counter
tgi_request_success 10
# TYPE tgi_request_failure counter
tgi_request_failure{err="validation"} 2
tgi_request_failure{err="overloaded"} 1
# TYPE tgi_queue_size gauge
tgi_queue_size 5
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 8
# TYPE tgi_batch_max_total_tokens gauge
tgi_batch_max_total_tokens 65536
# TYPE tgi_batch_forward_duration histogram
tgi_batch_forward_duration_bucket{method="decode",le="0.01"} 3
tgi_batch_forward_duration_bucket{method="decode",le="0.1"} 9
tgi_batch_forward_duration_bucket{method="decode",le="+Inf"} 10
tgi_batch_forward_duration_sum{method="decode"} 0.5
tgi_batch_forward_duration_count{method="decode"} 10
tgi_batch_forward_duration_bucket{method="prefill",le="0.01"} 0
tgi_batch_forward_duration_bucket{method="prefill",le="0.1"} 1
tgi_batch_forward_duration_bucket{method="prefill",le="+Inf"} 2
tgi_batch_forward_duration_sum{method="prefill"} 0.9
tgi_batch_forward_duration_count{method="prefill"} 2
"""


def scrape(path_or_text, t=0.0):
    text = path_or_text.read_text() if isinstance(path_or_text, Path) else path_or_text
    return parse_scrape(text, t, server="s1")


# -- tables --------------------------------------------------------------------------------

def test_tables_only_use_known_neutral_names():
    for t in TABLES:
        for w in t.metrics + t.legacy:
            assert w.neutral.startswith("config:") or w.neutral in NEUTRAL, (t.name, w.wire)


def test_docs_matrix_lists_every_wire_name():
    doc = (Path(__file__).parents[1] / "docs" / "engines.md").read_text()
    missing = [w.wire for t in TABLES for w in t.metrics + t.legacy if f"`{w.wire}" not in doc]
    missing += [i.wire for t in TABLES for i in t.info if i.wire not in doc]
    missing += [n for n in NEUTRAL if f"`{n}`" not in doc]
    assert not missing, f"docs/engines.md lacks {missing}"


# -- detection and mapping on real scrapes -------------------------------------------------

@pytest.mark.parametrize("path,engine", [(VLLM_V0, "vllm"), (SGL, "sglang"), (SGL_EARLY, "sglang"),
                                         (TRT, "trtllm"), (DCGM, "dcgm")])
def test_engine_detected(path, engine):
    sample, _, found = scrape(path)
    assert found == engine and sample.engine == engine and sample.server == "s1"


def test_vllm_v0_values_and_cache_config():
    s, cfg, _ = scrape(VLLM_V0)
    assert s.values["prompt_tokens_total"] == 148.0
    assert s.values["generation_tokens_total"] == 955.0
    assert s.values["request_success_total"] == 4.0
    assert s.values["preemptions_total"] == 0.0  # vllm:num_preemptions_total
    assert s.values["kv_usage_frac"] == 0.0      # old name vllm:gpu_cache_usage_perc
    assert s.values["requests_swapped"] == 0.0
    assert "prefix_cache_hit_rate" not in s.values  # -1 means prefix caching is off
    assert cfg["model"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert cfg["kv_block_size_tokens"] == 16 and cfg["kv_num_gpu_blocks"] == 81767
    assert cfg["kv_capacity_tokens"] == 16 * 81767 == s.values["kv_capacity_tokens"]
    assert cfg["prefix_caching"] is False and cfg["kv_cache_dtype"] == "auto"
    assert cfg["gpu_memory_utilization_frac"] == 0.9
    assert cfg["raw"]["vllm:cache_config_info"]["swap_space_bytes"] == "4294967296"


def test_sglang_values_and_histograms():
    s, cfg, _ = scrape(SGL)
    v = s.values
    assert v["requests_running"] == 162 and v["requests_waiting"] == 2826
    assert v["kv_usage_frac"] == 0.28 and v["kv_used_tokens"] == 123859
    assert v["prefix_cache_hit_rate"] == pytest.approx(0.007507552643049313)
    assert v["prompt_tokens_total"] == 8128902 and v["gen_throughput_tokens_per_s"] == pytest.approx(86.508, abs=1e-3)
    ttft = s.histograms["ttft_seconds"]
    assert ttft["count"] == 11008 and ttft["le"][0] == 0.001 and ttft["le"][-1] == 30.0 and ttft["cum"][-1] == 2513
    assert s.histograms["itl_seconds"]["count"] == 7400757  # old sglang:time_per_output_token_seconds
    assert cfg["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    # since server start: rank 1100.8 lies in (7.5, 10] holding 941..1330
    assert histogram_quantile(0.1, None, ttft) == pytest.approx(7.5 + 2.5 * (1100.8 - 941) / (1330 - 941))
    assert histogram_quantile(0.5, None, ttft) == 30.0  # in +Inf: the highest finite bound


def test_sglang_early_names_label_name_and_percent_hit_rate():
    s, cfg, _ = scrape(SGL_EARLY)
    assert s.values["prefix_cache_hit_rate"] == pytest.approx(0.1061)  # 10.61 %
    assert s.values["kv_usage_frac"] == 0.01 and s.values["requests_running"] == 0
    assert s.values["kv_capacity_tokens"] == 161721 == cfg["kv_capacity_tokens"]
    assert cfg["context_len_tokens"] == 8192 and cfg["max_running_requests"] == 4097
    assert cfg["model"] == "google/gemma-2-9b-it"
    assert s.histograms["queue_seconds"]["count"] == 2104  # sglang:waiting_request_latency_seconds


def test_trtllm_triton_block_metrics():
    s, cfg, _ = scrape(TRT)
    assert s.values["requests_waiting"] == 1 and s.values["requests_running"] == 0  # type active
    assert s.values["kv_usage_frac"] == 0.4875  # the backend's own fraction wins over used/max
    assert cfg["kv_block_size_tokens"] == 64 and cfg["kv_num_gpu_blocks"] == 6239
    assert cfg["kv_capacity_tokens"] == 64 * 6239 and cfg["max_running_requests"] == 512
    assert s.values["kv_used_tokens"] == 64  # 1 used block × 64 tokens


def test_dcgm_units():
    s, cfg, _ = scrape(DCGM)
    assert s.values["gpu_mem_free_bytes"] == 15109 * 1024 * 1024
    assert s.values["gpu_mem_used_bytes"] == 0
    assert s.values["gpu_power_w"] == pytest.approx(8.969)
    assert s.values["gpu_dram_active_frac"] == pytest.approx(3e-6)  # a ratio already
    assert cfg["gpu_name"] == "Tesla T4"


# -- renames, aggregation, other engines ----------------------------------------------------

def test_vllm_renamed_names_and_no_double_count():
    text = """# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m",engine="0"} 0.5
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.6
vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.8
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="m",engine="0"} 100
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 7
vllm:request_success_total{finished_reason="length",model_name="m"} 2
vllm:request_success_total{finished_reason="abort",model_name="m"} 1
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="m"} 1
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 4
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.2
vllm:time_per_output_token_seconds_count{model_name="m"} 4
"""
    s, _, _ = scrape(text)
    assert s.values["kv_usage_frac"] == pytest.approx(0.7)  # new name only, mean of the two engines
    assert s.values["prefix_cache_queries_total"] == 100
    assert s.values["request_success_total"] == 9 and s.values["request_aborted_total"] == 1
    assert s.histograms["itl_seconds"] == {"le": [0.01], "cum": [1.0], "sum": 0.2, "count": 4.0}
    assert "tpot_seconds" not in s.histograms
    old_only, _, _ = scrape('# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n')
    assert old_only.values["kv_usage_frac"] == 0.5


def test_counts_sum_over_model_series_and_router_underscores():
    text = """sglang_num_running_reqs{model_name="a"} 3
sglang_num_running_reqs{model_name="b"} 4
"""
    s, _, engine = scrape(text)
    assert engine == "sglang" and s.values["requests_running"] == 7


def test_untyped_histogram_and_dynamo_prefix():
    text = """trtllm:time_to_first_token_seconds_bucket{le="0.5"} 3
trtllm:time_to_first_token_seconds_bucket{le="+Inf"} 4
trtllm:time_to_first_token_seconds_sum 1.5
trtllm:time_to_first_token_seconds_count 4
"""
    s, _, engine = scrape(text)
    assert engine == "trtllm"
    assert s.histograms["ttft_seconds"] == {"le": [0.5], "cum": [3.0], "sum": 1.5, "count": 4.0}


def test_mixed_engine_and_gpu_scrape():
    text = VLLM_V0.read_text() + DCGM.read_text()
    s, cfg, engine = scrape(text)
    assert engine == "vllm" and s.values["prompt_tokens_total"] == 148
    assert s.values["gpu_mem_free_bytes"] == 15109 * 2**20 and cfg["gpu_name"] == "Tesla T4"


def test_llamacpp_from_server_format():
    s, _, engine = scrape(LLAMACPP)
    assert engine == "llamacpp"
    v = s.values
    assert v["requests_running"] == 4 and v["requests_deferred"] == 3 and v["requests_waiting"] == 3
    assert v["prompt_tokens_total"] == 6886 and v["generation_tokens_total"] == 3469
    assert v["prompt_seconds_total"] == pytest.approx(2.903) and v["decode_seconds_total"] == pytest.approx(35.44)
    assert v["engine_steps_total"] == 3480


def test_llamacpp_config_from_props_and_slots():
    props = {"default_generation_settings": {"n_ctx": 4096, "params": {}}, "total_slots": 2,
             "model_alias": "", "model_path": "/models/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf"}
    slots = [{"id": 0, "n_ctx": 4096, "is_processing": True}, {"id": 1, "n_ctx": 4096, "is_processing": False}]
    cfg = llamacpp_config_from_props(props, slots)
    assert cfg["n_ctx"] == 4096 and cfg["total_slots"] == cfg["parallel"] == 2
    assert cfg["model"] == "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf" and cfg["slot_n_ctx"] == [4096, 4096]
    assert llamacpp_config_from_props({"model_alias": "tiny"}, [])["model"] == "tiny"


def test_tgi_counters_without_total_and_step_histograms():
    s, cfg, engine = scrape(TGI)
    assert engine == "tgi"
    assert s.values["request_success_total"] == 10 and s.values["request_failure_total"] == 3
    assert s.values["requests_waiting"] == 5 and s.values["requests_running"] == 8
    assert cfg["kv_capacity_tokens"] == 65536
    assert s.histograms["step_decode_seconds"]["cum"] == [3.0, 9.0]
    assert s.histograms["step_prefill_seconds"]["count"] == 2


def test_histograms_serialise_without_infinity():
    s, _, _ = scrape(SGL)
    back = orjson.loads(orjson.dumps(to_dict(s)))
    assert back["histograms"]["ttft_seconds"]["le"] == s.histograms["ttft_seconds"]["le"]
    assert all(x is not None for x in back["histograms"]["ttft_seconds"]["le"])


# -- rates ---------------------------------------------------------------------------------

BEFORE = {"le": [0.1, 0.5, 1.0], "cum": [2, 5, 6], "sum": 2.0, "count": 6}
AFTER = {"le": [0.1, 0.5, 1.0], "cum": [4, 15, 18], "sum": 9.0, "count": 20}


def test_histogram_quantile_hand_computed():
    # window: cum [2, 10, 12], +Inf 14
    assert histogram_quantile(0.5, BEFORE, AFTER) == pytest.approx(0.1 + 0.4 * 5 / 8)  # rank 7
    assert histogram_quantile(0.1, BEFORE, AFTER) == pytest.approx(0.1 * 1.4 / 2)      # rank 1.4
    assert histogram_quantile(0.9, BEFORE, AFTER) == 1.0  # rank 12.6 in +Inf
    assert histogram_delta(BEFORE, AFTER) == {"le": [0.1, 0.5, 1.0], "cum": [2, 10, 12], "sum": 7.0, "count": 14}
    assert math.isnan(histogram_quantile(0.5, AFTER, AFTER))  # nothing observed
    assert math.isnan(histogram_quantile(0.5, None, {"le": [1.0], "cum": [3], "sum": None, "count": None}))
    # the +Inf bucket as JSON wrote it (null) is the count
    assert histogram_quantile(0.5, None, {"le": [0.1, 0.5, 1.0, None], "cum": [2, 10, 12, 14]}) == pytest.approx(0.35)


def test_histogram_reset_uses_later_snapshot():
    restarted = {"le": [0.1, 0.5, 1.0], "cum": [1, 2, 2], "sum": 0.5, "count": 2}
    assert histogram_delta(AFTER, restarted)["count"] == 2
    assert histogram_quantile(0.5, AFTER, restarted) == pytest.approx(0.1)  # rank 1 of 2, all in (0, 0.1]


def test_counter_reset():
    t, v = [0, 10, 20, 30], [100, 150, 20, 50]
    assert list(counter_rate(t, v)) == [5.0, 2.0, 3.0]  # 150→20 is a restart: 20 since it
    assert counter_increase(v) == 100
    r = counter_rate([0, 10, 10], [1, 2, 3])
    assert r[0] == 0.1 and math.isnan(r[1])
    assert counter_increase([1, float("nan"), 4]) == 3


def test_window_quantiles_over_samples():
    samples = [EngineSample(time_s=t, server="a", histograms={"ttft_seconds": h})
               for t, h in ((0, BEFORE), (10, AFTER), (20, AFTER))]
    out = window_quantiles(samples, 0, 10, [0.5, 0.9])
    assert out["ttft_seconds"][0.5] == pytest.approx(0.35) and out["ttft_seconds"][0.9] == 1.0
    series = {"ttft_seconds": [(0, BEFORE), (10, AFTER)]}  # the capture reader's shape
    assert window_quantiles(series, 0, 10, [0.5])["ttft_seconds"][0.5] == pytest.approx(0.35)
    assert math.isnan(window_quantiles(samples, 10, 20, [0.5])["ttft_seconds"][0.5])


# -- errors and the importer ----------------------------------------------------------------

def test_malformed_scrape_names_line(tmp_path):
    bad = tmp_path / "bad.prom"
    bad.write_text('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n'
                   'vllm:num_requests_waiting{a="b" 2\n')
    with pytest.raises(InputError, match=r"bad.prom: line 3: cannot parse"):
        prometheus.read([bad], {})


def test_unknown_metrics_rejected(tmp_path):
    other = tmp_path / "node.prom"
    other.write_text("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12\n")
    with pytest.raises(InputError) as e:
        prometheus.read([other], {})
    assert str(e.value) == (f"{other}: no metrics of a known engine (vLLM, SGLang, TGI, llama.cpp, TensorRT-LLM, "
                            "DCGM) found; expected Prometheus text from /metrics")


def test_importer_interval_and_config_event():
    imp = prometheus.read([VLLM_V0, VLLM_V0], {"interval_s": "15", "server": "gpu-1"})
    recs = list(imp.records)
    assert imp.meta.engine == "vllm" and imp.meta.model == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert imp.meta.clock == "relative" and imp.meta.config["kv_capacity_tokens"] == 1308272
    assert isinstance(recs[0], Event) and recs[0].kind == "config" and recs[0].detail["kv_block_size_tokens"] == 16
    samples = [r for r in recs if isinstance(r, EngineSample)]
    assert [s.time_s for s in samples] == [0.0, 15.0] and samples[0].server == "gpu-1"
    assert sum(isinstance(r, Event) for r in recs) == 1  # config unchanged: one event


def test_importer_mtime_order_and_props(tmp_path):
    a, b = tmp_path / "a.prom", tmp_path / "b.prom"
    a.write_text(LLAMACPP)
    b.write_text(LLAMACPP.replace("llamacpp:prompt_tokens_total 6886", "llamacpp:prompt_tokens_total 7000"))
    os.utime(a, (2_000_000_000, 2_000_000_000))
    os.utime(b, (1_900_000_000, 1_900_000_000))
    props = tmp_path / "props.json"
    props.write_text('{"default_generation_settings": {"n_ctx": 8192}, "total_slots": 4, "model_alias": "m"}')
    imp = prometheus.read([a, b], {"props": str(props)})
    samples = [r for r in imp.records if isinstance(r, EngineSample)]
    assert [s.time_s for s in samples] == [1_900_000_000, 2_000_000_000]
    assert [s.values["prompt_tokens_total"] for s in samples] == [7000, 6886]
    assert imp.meta.clock == "unix" and imp.meta.engine == "llamacpp"
    assert imp.meta.model == "m" and imp.meta.config["n_ctx"] == 8192 and imp.meta.config["total_slots"] == 4


# -- vLLM 0.32, recorded from a running server (tests/test_vllm.py checks the live page the same way)

VLLM_032 = {name: DATA / f"vllm-0.32-cpu-under-{name}.prom" for name in ("load", "preemption")}


@pytest.mark.parametrize("name", sorted(VLLM_032))
def test_vllm_032_page_maps_completely(name):
    from kvdoctor.engines.promtext import _key, parse_families
    from kvdoctor.engines.vllm import IGNORED, TABLE

    text = VLLM_032[name].read_text()
    names = {_key(f.name) for f in parse_families(text) if f.name.startswith("vllm:") and not f.name.endswith("_created")}
    known = {_key(w.wire) for w in TABLE.metrics} | {_key(i.wire) for i in TABLE.info} | {_key(n) for n in IGNORED}
    assert not names - known, f"{sorted(names - known)} neither mapped nor in vllm.IGNORED"
    assert not {_key(n) for n in IGNORED} - names, "IGNORED lists a name vLLM 0.32 does not have"


def test_vllm_032_preemption_page_values_and_cache_config():
    s, cfg, engine = prometheus_scrape(VLLM_032["preemption"])
    assert engine == "vllm"
    # mid-preemption: one request waits for capacity while three run on a 7/8-full cache
    assert (s.values["requests_running"], s.values["requests_waiting"], s.values["requests_waiting_capacity"]) == (3, 1, 1)
    assert s.values["kv_usage_frac"] == 0.875 and s.values["preemptions_total"] == 10
    assert s.values["requests_rejected_total"] == 0 and s.values["read_bytes_total"] == 0  # MFU stats off
    # cache_config_info: the capacity vLLM itself states, not blocks x block size recomputed
    assert cfg["kv_capacity_tokens"] == int(cfg["raw"]["vllm:cache_config_info"]["kv_cache_size_tokens"])
    assert cfg["kv_block_size_tokens"] == 128
    assert cfg["prefix_caching"] is (cfg["raw"]["vllm:cache_config_info"]["enable_prefix_caching"] == "True")
    assert cfg["kv_cache_bytes"] == int(cfg["raw"]["vllm:cache_config_info"]["kv_cache_memory_bytes"])
    assert "prefill_seconds" in s.histograms and "queue_seconds" in s.histograms


def prometheus_scrape(path):
    from kvdoctor.engines import parse_scrape

    return parse_scrape(path.read_text(), 0.0, "s1")


def test_vllm_config_from_models():
    from kvdoctor.engines.vllm import vllm_config_from_models

    models = {"object": "list", "data": [{"id": "smollm2", "max_model_len": 2048}, {"id": "default", "max_model_len": 2048}]}
    assert vllm_config_from_models(models) == {"context_len_tokens": 2048}
    assert vllm_config_from_models({"data": [{"id": "x"}]}) == {} and vllm_config_from_models([]) == {}
