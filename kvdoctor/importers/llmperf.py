"""llmperf's per-request results: ``*_individual_responses.json`` (ray-project/llmperf).

The file is a JSON list with one object per request::

    {"error_code": null, "error_msg": "", "inter_token_latency_s": 0.0187, "ttft_s": 0.428,
     "end_to_end_latency_s": 2.91, "request_output_throughput_token_per_s": 52.2,
     "number_total_tokens": 701, "number_output_tokens": 151, "number_input_tokens": 550}

Mapping: ``ttft_s`` -> ttft_s, ``end_to_end_latency_s`` -> e2e_s, ``number_input_tokens`` ->
prompt_tokens, ``number_output_tokens`` -> output_tokens, ``error_code``/``error_msg`` -> status,
error and (for 100-599 codes) http_status, the status from kvdoctor/error_classes.py (llmperf's
own -100 "Output too few tokens" flags a *completed* request: status ok, error text kept); ``start_time`` (newer llmperf: seconds since the test
started) -> arrival_s on a relative clock. Older files carry no send times, so arrivals stay unset.

``inter_token_latency_s`` is not a mean gap between tokens: llmperf sums every chunk gap *including
the TTFT* and divides by the output tokens, so it is about e2e / output_tokens. It is not stored;
TPOT is derived as (e2e - ttft) / (output_tokens - 1), the definition the other importers use.
Timings of errored requests that are 0 mean "not measured" and are left unset. Text is never kept.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import orjson

from .. import error_classes
from ..errors import InputError
from ..model import CaptureMeta, RequestRecord, derive_request
from . import integer, num, parse_options, request_id_for
from .base import Imported

NAME = "llmperf"
SUMMARY = "llmperf *_individual_responses.json (per-request ttft_s, end_to_end_latency_s, token counts)"
GLOB = ("*_individual_responses.json", "*.json")
OPTIONS: dict[str, str] = {}


def _load(path: Path) -> list[Any]:
    try:
        data = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise InputError(f"{path}: line {e.lineno}: not valid JSON ({e.msg}); expected llmperf's "
                         "*_individual_responses.json (a JSON list of per-request objects)") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    if isinstance(data, dict):
        if "results" in data or "num_concurrent_requests" in data:
            raise InputError(f"{path}: this is llmperf's *_summary.json (aggregates only); import the "
                             "*_individual_responses.json written next to it")
        raise InputError(f"{path}: expected a JSON list of per-request objects, got an object")
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of per-request objects, got {type(data).__name__}")
    return data


def _record(path: Path, item: Any, i: int, rid: str) -> RequestRecord:
    where = f"{path}: [{i}]"
    if not isinstance(item, dict):
        raise InputError(f"{where}: expected an object with ttft_s, end_to_end_latency_s, ...; got {type(item).__name__}")
    if not any(k in item for k in ("ttft_s", "end_to_end_latency_s", "number_input_tokens")):
        raise InputError(f"{where}: no llmperf fields (ttft_s, end_to_end_latency_s, number_input_tokens); "
                         f"keys are {', '.join(sorted(item)[:10])}")
    code = item.get("error_code")
    msg = item.get("error_msg") or None
    if msg is not None and not isinstance(msg, str):
        msg = str(msg)[:1000]  # a number or a list where text was expected: kept as text, not trusted
    if code is not None:
        code = integer(code, f"{where}.error_code")
    flagged = code is not None or msg is not None
    ttft = num(item.get("ttft_s"), f"{where}.ttft_s")
    e2e = num(item.get("end_to_end_latency_s"), f"{where}.end_to_end_latency_s")
    # llmperf's negative codes are its own checks (-100: "Output too few tokens", a completed
    # request that stopped early); 100-599 are HTTP statuses. The classifier tells them apart.
    status, cls = error_classes.status_for(code, None, msg) if flagged else ("ok", None)
    if flagged and (error_classes.CLASSES[cls].failure if cls else True):
        ttft = ttft or None  # 0 on an errored request = never measured
        e2e = e2e or None
    error = None
    if flagged:
        error = str(msg) if msg is not None else f"error code {code}"
        if msg is not None and code is not None and str(code) not in error:
            error = f"{error} (code {code})"
    return derive_request(RequestRecord(
        request_id=rid,
        arrival_s=num(item.get("start_time"), f"{where}.start_time"),
        ttft_s=ttft,
        e2e_s=e2e,
        prompt_tokens=integer(item.get("number_input_tokens"), f"{where}.number_input_tokens"),
        output_tokens=integer(item.get("number_output_tokens"), f"{where}.number_output_tokens"),
        status=status,
        error=error,
        http_status=code if code is not None and 100 <= code <= 599 else None,
    ))


def read(paths: list[Path], options: dict[str, Any]) -> Imported:
    parse_options(NAME, options, {})
    first = _load(paths[0])  # read now: a bad file fails before anything is written
    has_start = any(isinstance(x, dict) and x.get("start_time") is not None for x in first[:50])

    def records() -> Iterator[RequestRecord]:
        short = total = 0
        for n, path in enumerate(paths):
            data = first if n == 0 else _load(path)
            for i, item in enumerate(data):
                rec = _record(path, item, i, request_id_for(len(paths), path.stem, i))
                total += 1
                short += rec.status == "ok" and rec.error is not None
                yield rec
        if short:  # the capture's readers say it too, on every output (kvdoctor/capture/reader.py)
            notes.append(f"{short} of {total} requests ended before max_tokens (llmperf's \"Output too few tokens\"): "
                         "completed, not failures; throughput figures are per actual output")

    notes = ["llmperf inter_token_latency_s (≈ e2e/output tokens, TTFT included) not stored; "
             "TPOT derived as (e2e - ttft)/(output_tokens - 1)"]
    if not has_start:
        notes.append("no per-request start times in the file: arrivals unknown, time-based views are unavailable")
    meta = CaptureMeta(clock="relative", origin=f"import:{NAME}", arrivals_known=True if has_start else False)
    return Imported(meta=meta, records=records(), notes=notes)
