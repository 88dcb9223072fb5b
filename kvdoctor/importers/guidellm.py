"""GuideLLM benchmark reports (vllm-project/guidellm): ``benchmarks.json`` or ``.yaml``.

A report holds one or more benchmarks (a sweep runs one per rate), each with its per-request rows::

    {"benchmarks": [{"requests": {"successful": [ROW, ...], "errored": [...], "incomplete": [...]}, ...}]}

A row (``generative_request_stats``; older ``generative_text_response``) carries ``request_id``,
``prompt_tokens``, ``output_tokens``, ``time_to_first_token_ms``, ``request_latency`` (s) and the
request's start and end on the Unix clock: ``request_start_time``/``request_end_time`` (newer),
``start_time``/``end_time`` (older), else ``info.timings``/``scheduler_info``. Errors: ``error`` or
``info.error``, classified by kvdoctor/error_classes.py. "incomplete" rows are requests GuideLLM
cancelled when the benchmark's time ran out: status "cancelled", not failures. TPOT is derived as
(e2e - TTFT) / (output_tokens - 1), which is GuideLLM's own ``inter_token_latency_ms``. Request ids
are prefixed ``bN/`` by benchmark when a report holds several. Prompt and output text are never kept.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import orjson

from .. import error_classes
from ..errors import InputError
from ..model import CaptureMeta, RequestRecord, derive_request
from . import describe, integer, num, parse_options
from .base import Imported

NAME = "guidellm"
SUMMARY = "GuideLLM benchmarks.json / .yaml reports (per-request rows of every benchmark in a sweep)"
GLOB = ("benchmarks.json", "benchmarks.yaml", "*.json", "*.yaml", "*.yml")
OPTIONS: dict[str, str] = {}

_KINDS = (("successful", "ok"), ("errored", "error"), ("incomplete", "cancelled"))


def _load(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f"line {mark.line + 1}: " if mark is not None else ""
            raise InputError(f"{path}: {line}not valid YAML; expected a GuideLLM benchmarks report") from None
    else:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise InputError(f"{path}: line {e.lineno}: not valid JSON ({e.msg}); expected a GuideLLM "
                             "benchmarks report") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        keys = ", ".join(sorted(data)[:8]) if isinstance(data, dict) else type(data).__name__
        raise InputError(f"{path}: expected a GuideLLM report with a \"benchmarks\" list; got {keys}")
    return data


def _first(row: dict[str, Any], where: str, *paths: str) -> float | None:
    """The first of these (dotted) fields that is set, as a number."""
    for p in paths:
        v: Any = row
        for part in p.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if v is not None:
            return num(v, f"{where}.{p}")
    return None


def _record(row: Any, where: str, kind_status: str, rid: str) -> RequestRecord:
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a request row (object), got {describe(row)}")
    if not any(k in row for k in ("request_id", "prompt_tokens", "time_to_first_token_ms", "request_latency")):
        raise InputError(f"{where}: no GuideLLM request fields (request_id, prompt_tokens, "
                         f"time_to_first_token_ms, request_latency); keys are {', '.join(sorted(row)[:10])}")
    start = _first(row, where, "request_start_time", "start_time", "info.timings.request_start",
                   "scheduler_info.request_start")
    end = _first(row, where, "request_end_time", "end_time", "info.timings.request_end", "scheduler_info.request_end")
    ttft_ms = _first(row, where, "time_to_first_token_ms")
    latency = _first(row, where, "request_latency")
    info = row.get("info") if isinstance(row.get("info"), dict) else {}
    text = row.get("error") or info.get("error")
    status = kind_status
    if kind_status == "error":
        status = error_classes.record_status(None, None, str(text) if text else None) or "error"
        text = str(text) if text else "request errored (no error text in the report)"
    elif kind_status == "cancelled":
        text = "cancelled by GuideLLM at the end of the benchmark (incomplete)"
    else:
        text = None
    return derive_request(RequestRecord(
        request_id=rid,
        arrival_s=start,
        finish_s=end if kind_status == "ok" else None,
        ttft_s=ttft_ms / 1000 if ttft_ms is not None else None,
        e2e_s=latency if kind_status == "ok" else None,
        prompt_tokens=integer(_first(row, where, "prompt_tokens"), f"{where}.prompt_tokens"),
        output_tokens=integer(_first(row, where, "output_tokens"), f"{where}.output_tokens"),
        cached_prompt_tokens=integer(_first(row, where, "cached_tokens"), f"{where}.cached_tokens"),
        status=status,
        error=text,
    ))


def read(paths: list[Path], options: dict[str, Any]) -> Imported:
    parse_options(NAME, options, {})
    first = _load(paths[0])  # read now: a bad file fails before anything is written
    many_files = len(paths) > 1

    def records() -> Iterator[RequestRecord]:
        for n, path in enumerate(paths):
            data = first if n == 0 else _load(path)
            benches = data["benchmarks"]
            for b, bench in enumerate(benches):
                reqs = bench.get("requests") if isinstance(bench, dict) else None
                if not isinstance(reqs, dict):
                    raise InputError(f"{path}: benchmarks[{b}].requests: expected {{successful, errored, incomplete}}, "
                                     f"got {describe(reqs)}")
                prefix = (f"{path.stem}/" if many_files else "") + (f"b{b}/" if len(benches) > 1 else "")
                for kind, status in _KINDS:
                    rows = reqs.get(kind) or []
                    if not isinstance(rows, list):
                        raise InputError(f"{path}: benchmarks[{b}].requests.{kind}: expected a list of request "
                                         f"rows, got {describe(rows)}")
                    for i, row in enumerate(rows):
                        where = f"{path}: benchmarks[{b}].requests.{kind}[{i}]"
                        rid = row.get("request_id") if isinstance(row, dict) else None
                        yield _record(row, where, status, f"{prefix}{rid or f'{kind}/{i}'}")

    benches = first["benchmarks"]
    notes = []
    sampled = [b.get("request_totals") or {} for b in benches if isinstance(b, dict)]
    if any(isinstance(t, dict) and (t.get("successful") or 0) > len(((b.get("requests") or {}).get("successful") or []))
           for t, b in zip(sampled, benches)):
        notes.append("the report keeps a sample of each benchmark's requests (GuideLLM --output-sampling): "
                     "rates and counts are of the sample, not the run")
    meta = CaptureMeta(clock="unix", origin=f"import:{NAME}",
                       config={"benchmark": {"tool": "guidellm", "benchmarks": len(benches)}})
    return Imported(meta=meta, records=records(), notes=notes)
