"""The records a capture holds. Units are in the field names; times are seconds.

Times (`*_s` fields that are instants) are on the capture's clock: Unix epoch seconds when the
source knew wall time, otherwise seconds from an arbitrary origin (``CaptureMeta.clock``).
Durations (`ttft_s`, `tpot_s`, ...) are seconds. Every field but the id is optional: a source
fills what it knows, and :func:`derive_request` fills what can be computed from the rest.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

FORMAT_VERSION = 1

#: Record kinds, one append-only stream each (see docs/capture-format.md).
KINDS = ("requests", "gpu", "host", "engine", "events")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    #: inter-token latencies, one per gap between output chunks (may be omitted for size)
    itl_s: list[float] | None = None
    #: how many gaps there were, when ``itl_s`` holds only the first ones (the writer caps long lists;
    #: the ITL summaries below are over all of them)
    itl_count: int | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    itl_max_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None
    #: the engine's own split of the request (vLLM llm_request span): time in prefill (scheduled
    #: to first token) and in decode (first token to the last); queue_s + prefill_s is its TTFT
    #: less the API server's own time, prefill_s + decode_s its time in the model
    prefill_s: float | None = None
    decode_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    session_id: str | None = None
    turn: int | None = None
    #: ids of the prompt's prefix blocks, in order; equal ids mean equal prefixes up to that block
    prefix_block_hashes: list[int] | None = None
    #: how many blocks the prompt had, when ``prefix_block_hashes`` holds only the first ones
    prefix_blocks_count: int | None = None
    prefix_block_tokens: int | None = None
    #: "ok", "error", "rejected", "cancelled"; "in-flight" only in the live window (not answered yet)
    status: str | None = None
    error: str | None = None
    http_status: int | None = None
    model: str | None = None
    server: str | None = None
    #: W3C trace id (32 hex) of the client's ``traceparent`` or the engine's span: joins the two
    trace_id: str | None = None
    #: the API path the request was sent to (``/v1/chat/completions``): objectives can be set per route
    route: str | None = None
    #: share of the output that repeats earlier n-grams (0 = none, 1 = all); no text kept
    output_repetition: float | None = None
    #: `kvdoctor quality`: the same prompt on a baseline server (greedy): how much of the output
    #: agrees before the first differing word (1 = identical), and the baseline's repetition
    baseline_agreement_frac: float | None = None
    baseline_output_repetition: float | None = None
    #: teacher-forced over the baseline's own greedy continuation: the share of positions where
    #: this server picks the same next token as the baseline (1 = identical)
    baseline_forced_agreement_frac: float | None = None
    #: only when the user asked for text to be stored (--store-text)
    prompt_text: str | None = field(default=None, metadata={"column": None})  # never loaded into columns
    output_text: str | None = field(default=None, metadata={"column": None})


@dataclass(frozen=True, slots=True)
class GpuSample:
    time_s: float
    gpu_index: int = field(metadata={"column": "int64"})
    name: str | None = None
    uuid: str | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    #: share of time a kernel ran (NVML utilization.gpu)
    sm_util_frac: float | None = None
    #: share of time device memory was read or written (NVML utilization.memory)
    mem_util_frac: float | None = None
    #: DRAM bandwidth used / peak (NVML GPM DRAM_BW_UTIL, Hopper and newer)
    dram_bw_util_frac: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    #: GPU memory held by the server's processes
    server_proc_mem_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class HostSample:
    time_s: float
    #: CPU of the server's process tree, in cores (1.0 = one core busy)
    server_cpu_cores: float | None = None
    server_rss_bytes: int | None = None
    server_pid: int | None = field(default=None, metadata={"column": "int64"})
    host_mem_used_bytes: int | None = None
    host_mem_total_bytes: int | None = None
    host_cpu_frac: float | None = None
    #: logical CPUs of the host: host_cpu_frac x this - server_cpu_cores = cores other processes took
    host_cpu_count: int | None = field(default=None, metadata={"column": "int64"})
    #: the server tree's threads' time runnable but not running (the kernel's run-queue delay,
    #: /proc/PID/task/TID/schedstat), in cores: 1.0 = on average one thread waited for a CPU
    #: (Linux only; None elsewhere and on the first collect)
    server_run_wait_cores: float | None = None


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape of an engine's metrics, mapped to engine-neutral names.

    ``values`` maps neutral names (kvdoctor.engines.NEUTRAL) to floats: gauges as read,
    counters as their running totals (rates are taken at analysis, so resets are handled once).
    ``histograms`` maps neutral names to cumulative buckets ``{"le": [...], "cum": [...],
    "sum": x, "count": n}``; percentiles over a window come from the difference of two scrapes.
    """

    time_s: float
    engine: str | None = None
    server: str | None = None
    values: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Event:
    time_s: float
    #: server-down, server-up, server-restart, oom, error-burst, config, preemption, note
    kind: str
    server: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SourceStatus:
    ok: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class CaptureMeta:
    format_version: int = FORMAT_VERSION
    created_unix_s: float | None = None
    #: "unix" when instants are epoch seconds, "relative" otherwise
    clock: str = "unix"
    engine: str | None = None
    #: the engine's own version string (vLLM "0.32.0", llama.cpp "b11434", ...), as the server reported it
    engine_version: str | None = None
    #: the served model's name as clients ask for it (vLLM/SGLang served name, llama.cpp alias or file name)
    model: str | None = None
    gpu: str | None = None
    server: str | None = None
    #: where the data came from: "attach", "import:llmperf", ...
    origin: str | None = None
    #: what each source could or could not read
    sources: dict[str, SourceStatus] = field(default_factory=dict)
    #: engine configuration seen (block size, KV dtype, max sequences, context length, ...)
    config: dict[str, Any] = field(default_factory=dict)
    #: true only when the user asked for prompt/completion text to be stored
    text_stored: bool = False
    attribution: str | None = None
    tool_version: str | None = None
    #: False when the source has no send (or finish) times, e.g. llmperf result files: requests
    #: are in file order and rates or anything per minute are unknown. None: not said (judged
    #: from the records)
    arrivals_known: bool | None = None


RECORD_TYPES = {
    "requests": RequestRecord,
    "gpu": GpuSample,
    "host": HostSample,
    "engine": EngineSample,
    "events": Event,
}


def to_dict(record: Any) -> dict[str, Any]:
    """A record as a plain dict without its unset (None) fields, for compact JSON."""
    out = {}
    for f in dataclasses.fields(record):
        v = getattr(record, f.name)
        if v is None or (isinstance(v, (dict, list)) and not v and f.name != "request_id"):
            continue
        if isinstance(v, dict):
            v = {k: (dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x) for k, x in v.items()}
        out[f.name] = v
    return out


def derive_request(r: RequestRecord) -> RequestRecord:
    """Fill the fields that follow from others (TTFT from first_token - arrival, TPOT from
    decode time / (output_tokens - 1), ...). Given values are never overwritten."""
    d = derived_fields(lambda name: getattr(r, name))
    return dataclasses.replace(r, **d) if d else r


def derived_fields(get: Callable[[str], Any]) -> dict[str, Any]:
    """What :func:`derive_request` fills, from ``get(field name)`` (None: unset): for a record
    still being built as keyword arguments (``derived_fields(kw.get)``), which then is made once
    instead of made and replaced (the proxy does this on its event loop for every request)."""
    d: dict[str, Any] = {}
    arrival, first, finish = get("arrival_s"), get("first_token_s"), get("finish_s")
    ttft, e2e, tpot = get("ttft_s"), get("e2e_s"), get("tpot_s")
    if ttft is None and first is not None and arrival is not None:
        ttft = d["ttft_s"] = first - arrival
    if e2e is None and finish is not None and arrival is not None:
        e2e = d["e2e_s"] = finish - arrival
    if finish is None and arrival is not None and e2e is not None:
        d["finish_s"] = arrival + e2e
    if first is None and arrival is not None and ttft is not None:
        d["first_token_s"] = arrival + ttft
    output_tokens = get("output_tokens")
    if tpot is None and e2e is not None and ttft is not None and output_tokens and output_tokens > 1:
        d["tpot_s"] = max(e2e - ttft, 0.0) / (output_tokens - 1)
    itl = get("itl_s")
    if itl and (get("itl_p50_s") is None or get("itl_p99_s") is None or get("itl_max_s") is None
                or (tpot is None and "tpot_s" not in d)):
        import numpy as np

        a = np.asarray(itl, dtype=float)
        if get("itl_p50_s") is None:
            d["itl_p50_s"] = float(np.percentile(a, 50))
        if get("itl_p99_s") is None:
            d["itl_p99_s"] = float(np.percentile(a, 99))
        if get("itl_max_s") is None:
            d["itl_max_s"] = float(a.max())
        if tpot is None and "tpot_s" not in d:
            d["tpot_s"] = float(a.mean())
    if get("status") is None:
        d["status"] = "error" if get("error") else "ok"
    return d
