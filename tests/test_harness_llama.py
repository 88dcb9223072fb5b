"""The real-server harness: a cached llama-server with SmolLM2-135M, driven by loadgen.

Needs the llama-server build (``scripts/get-llama-server`` makes it once per machine,
~15 min on 2 cores); with it cached, this file runs in well under a minute.
"""
import asyncio

import pytest

from harness.llama_server import LlamaServer
from harness.loadgen import run_load, short_prompts, summarize

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server():
    with LlamaServer(n_ctx=2048, parallel=2, threads=2) as srv:
        yield srv


def test_streaming_requests_have_ground_truth_timings(server):
    timings = asyncio.run(run_load(server.url, short_prompts(3, max_tokens=16), concurrency=2,
                                   timeout_s=60, max_duration_s=90))
    assert len(timings) == 3
    for t in timings:
        assert t.status == "ok", (t.error, server.log_tail())
        assert t.http_status == 200
        assert t.ttft_s is not None and t.ttft_s > 0
        assert t.e2e_s >= t.ttft_s
        assert t.output_tokens > 0
        assert t.prompt_tokens and t.prompt_tokens > 0
        assert t.chunk_times_s and t.send_s < t.chunk_times_s[0] <= t.chunk_times_s[-1] <= t.finish_s
        assert list(t.chunk_times_s) == sorted(t.chunk_times_s)
    s = summarize(timings)
    assert s["ok"] == 3 and s["ttft_p50_s"] > 0


def test_metrics_endpoint_is_prometheus_text(server):
    status, body = server.get("/metrics")
    assert status == 200
    assert "llamacpp:" in body
    assert "# TYPE" in body


def test_restart_keeps_port(server):
    port, pid = server.port, server.pid
    server.restart()
    assert server.port == port
    assert server.pid != pid
    assert server.health() == 200
    timings = asyncio.run(run_load(server.url, short_prompts(1, max_tokens=4), concurrency=1,
                                   timeout_s=60, max_duration_s=90))
    assert timings[0].status == "ok", timings[0].error


def test_harness_doc_block_runs_as_written():
    """docs/test-harness.md's first block: `scripts/get-llama-server` as written (cached: it only
    prints the binary and model paths), then its pytest line, collected only."""
    from conftest import doc_blocks_for, run_get_then_collect_block

    (block,) = doc_blocks_for("docs/test-harness.md", "tests/test_harness_llama.py")
    out = run_get_then_collect_block(block, "docs/test-harness.md (get-llama-server)")
    assert "llama-server: " in out and ".gguf" in out
