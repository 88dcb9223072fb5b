"""Which format a file looks like, from its first bytes and keys: for the error when a file is
given to the wrong importer ("this is llmperf's file: kvdoctor import llmperf ..."), rather than
the wrong importer's own complaint ("not valid JSON" about a valid JSON document).

Only unambiguous signatures are claimed (a key set one format writes and no other); anything
else is None, and the importer's own error stands. Used on the error path only: a file that
imports is never read twice.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson

#: a file this big is judged by its first line only (a whole-document parse would cost seconds)
WHOLE_LIMIT_BYTES = 64 << 20
HEAD_BYTES = 1 << 20

#: format -> how the error names it
LABELS = {
    "vllm-bench": "a `vllm bench serve` result", "llmperf": "llmperf's *_individual_responses.json",
    "aiperf": "AIPerf's profile_export.jsonl", "guidellm": "a GuideLLM benchmarks report",
    "otlp-json": "OTLP/JSON traces", "mooncake": "a Mooncake trace", "prometheus": "Prometheus text (a /metrics scrape)",
    "csv": "a CSV file",
}

_PROM_LINE = re.compile(rb"^(# (HELP|TYPE) [a-zA-Z_:][\w:]* |[a-zA-Z_:][\w:]*(\{[^}]*\})? [-+0-9.eE]+|[a-zA-Z_:][\w:]*(\{[^}]*\})? (NaN|[+-]Inf))")


def _of_object(obj: Any) -> str | None:
    """The format one JSON value (a whole document or one JSON Lines record) belongs to."""
    if isinstance(obj, list):
        first = next((x for x in obj if isinstance(x, dict)), None)
        if first is not None and {"ttft_s", "end_to_end_latency_s", "number_input_tokens"} & set(first):
            return "llmperf"
        return None
    if not isinstance(obj, dict):
        return None
    keys = set(obj)
    if "resourceSpans" in keys:
        return "otlp-json"
    if "benchmarks" in keys:
        return "guidellm"
    if {"ttfts", "input_lens"} & keys or {"mean_ttft_ms", "request_throughput"} <= keys:
        return "vllm-bench"
    if {"metadata", "metrics"} <= keys:
        return "aiperf"
    if {"timestamp", "input_length"} <= keys or {"timestamp", "hash_ids"} <= keys:
        return "mooncake"
    if "results" in keys and "num_concurrent_requests" in keys:
        return "llmperf"
    return None


def guess(path: Path) -> str | None:
    """The format ``path``'s content looks like, or None when no signature is certain."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        return None
    text = head.lstrip(b"\xef\xbb\xbf").lstrip()
    if not text:
        return None
    if text[:1] in (b"{", b"["):
        if size <= WHOLE_LIMIT_BYTES:
            try:
                found = _of_object(orjson.loads(path.read_bytes()))
            except (orjson.JSONDecodeError, OSError):
                found = None
            if found:
                return found
        first = text.split(b"\n", 1)[0]
        try:
            return _of_object(orjson.loads(first))
        except orjson.JSONDecodeError:
            return None
    if text.startswith(b"benchmarks:"):
        return "guidellm"
    lines = [ln for ln in text.split(b"\n")[:20] if ln.strip()]
    if lines and all(_PROM_LINE.match(ln) for ln in lines[:-1] or lines):
        return "prometheus"
    if _CSV_HEADER.match(lines[0].rstrip(b"\r")):
        return "csv"
    return None


#: a header row: two or more plain column names (a YAML "key: value" line has a colon, a log line prose)
_CSV_HEADER = re.compile(rb"^\s*\"?[\w .()/%-]+\"?(\s*,\s*\"?[\w .()/%-]+\"?)+\s*$")


def empty(path: Path) -> bool:
    """Whether ``path`` holds nothing but whitespace (an empty file gives every importer's own,
    unrelated reason otherwise: "no start_times", "zero-length document")."""
    try:
        if path.stat().st_size > 4096:
            return False
        return not path.read_bytes().lstrip(b"\xef\xbb\xbf").strip()
    except OSError:
        return False


def wrong_format(path: Path, fmt: str) -> str | None:
    """The error's text when ``path`` is clearly another format's file than ``fmt``, else None."""
    other = guess(path)
    if other is None or other == fmt:
        return None
    expected = LABELS.get(fmt, fmt)
    return (f"{path}: this is {LABELS[other]}, not {expected}; import it with "
            f"`kvdoctor import {other} {path} -o CAPTURE`")
