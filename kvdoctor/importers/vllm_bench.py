"""vLLM's serving benchmark result: ``vllm bench serve --save-result --save-detailed``.

The file is one JSON object per run (``--append-result`` appends more, one per line). With
``--save-detailed`` it holds per-request lists of equal length, in send order:

* ``input_lens`` -> prompt_tokens, ``output_lens`` -> output_tokens,
* ``ttfts`` (s) -> ttft_s, ``itls`` (list of gaps per request, s) -> itl_s (and p50/p99/max),
* ``errors`` ("" when the request succeeded) -> status/error,
* ``start_times`` (newer vLLM; ``time.perf_counter()`` at send) -> arrival_s on a relative clock,
* ``e2els``/``latencies`` when present -> e2e_s; otherwise e2e = ttft + sum(itls), which is how
  vLLM measures latency (time of the last chunk since send),
* ``generated_texts``: never stored.

Run-level ``model_id``, ``date``, ``backend``, ``request_rate``, ``burstiness``, ``max_concurrency``
and ``num_prompts`` go to the capture meta (model, config["benchmark"]).

Arrivals: vLLM's result has no send times before ``start_times`` was added. Without them arrival_s
is left unset (the request rate is a Poisson *target*, so times cannot be reconstructed honestly).
A failed request has ``ttfts`` 0, empty ``itls`` and ``output_lens`` 0: those are left unset; so is
the 0 TTFT of a non-streaming backend.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import orjson

from .. import error_classes
from ..capture.jsonl import numbered
from ..errors import InputError
from ..model import CaptureMeta, RequestRecord, derive_request
from . import describe, integer, num, parse_options
from .base import Imported

NAME = "vllm-bench"
SUMMARY = "vLLM `vllm bench serve --save-result --save-detailed` result JSON (ttfts, itls, input/output lens)"
GLOB = "*.json"
OPTIONS = {"itl": "keep each request's inter-token gaps (default true; false keeps only ITL p50/p99/max)"}

_PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "errors", "start_times", "e2els", "latencies")
_RUN_META = ("date", "backend", "endpoint_type", "label", "model_id", "tokenizer_id", "num_prompts",
             "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed")


def _runs(path: Path) -> list[dict[str, Any]]:
    """The run objects in a result file (several when written with --append-result)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    try:
        doc = orjson.loads(raw)
        docs = doc if isinstance(doc, list) else [doc]
    except orjson.JSONDecodeError as first_err:
        docs = []
        for n, line in numbered(raw.splitlines()):  # --append-result: one JSON object per line
            try:
                docs.append(orjson.loads(line))
            except orjson.JSONDecodeError as e:
                where = f"line {first_err.lineno}" if n == 1 else f"line {n}"
                raise InputError(f"{path}: {where}: not valid JSON ({(first_err if n == 1 else e).msg}); "
                                 "expected the JSON written by `vllm bench serve --save-result --save-detailed`") from None
    for k, d in enumerate(docs):
        if not isinstance(d, dict):
            raise InputError(f"{path}: run {k + 1}: expected a JSON object, got {type(d).__name__}")
        if "ttfts" not in d or "input_lens" not in d:
            if "mean_ttft_ms" in d or "request_throughput" in d:
                raise InputError(f"{path}: run {k + 1}: no per-request data (ttfts, itls, input_lens): the result was "
                                 "saved without --save-detailed; rerun `vllm bench serve --save-result --save-detailed`")
            raise InputError(f"{path}: run {k + 1}: not a vLLM benchmark result; expected fields ttfts, itls, "
                             f"input_lens, output_lens, errors (keys: {', '.join(sorted(d)[:8])})")
        n = len(d["input_lens"]) if isinstance(d["input_lens"], list) else -1
        for key in _PER_REQUEST:
            v = d.get(key)
            if v is None:
                continue
            if not isinstance(v, list):
                raise InputError(f"{path}: run {k + 1}: field {key}: expected a list, got {type(v).__name__}")
            if len(v) != n:
                raise InputError(f"{path}: run {k + 1}: field {key} has {len(v)} entries but input_lens has {n}; "
                                 "expected one entry per request")
    return docs


def _request(path: Path, run_no: int, run: dict[str, Any], i: int, rid: str, origin: float | None,
             keep_itl: bool) -> RequestRecord:
    where = f"{path}: run {run_no}: request {i}"

    def at(key: str) -> Any:
        v = run.get(key)
        return v[i] if v is not None else None

    error = at("errors")
    if error is not None and not isinstance(error, str):
        error = str(error)
    ttft = num(at("ttfts"), f"{where}: ttfts")
    itl_raw = at("itls")
    if itl_raw is not None and not isinstance(itl_raw, list):
        raise InputError(f"{where}: itls: expected a list of seconds, got {describe(itl_raw)}")
    itl = [num(x, f"{where}: itls", allow_none=False) for x in itl_raw] if itl_raw else []
    out_len = integer(at("output_lens"), f"{where}: output_lens")
    failed = bool(error) or (not ttft and not itl and not out_len)
    start = num(at("start_times"), f"{where}: start_times")
    arrival = start - origin if start is not None and origin is not None else None
    prompt = integer(at("input_lens"), f"{where}: input_lens")
    if failed:
        # the error text is the client's exception (e.g. "429, message='Too Many Requests'"):
        # the classifier decides rejected / cancelled / error
        status = error_classes.status_for(None, None, error)[0] if error else "error"
        return derive_request(RequestRecord(request_id=rid, arrival_s=arrival, prompt_tokens=prompt,
                                            status=status if status != "ok" else "error",
                                            error=error or "request failed (no error text in the result)"))
    if not ttft and not itl:
        ttft = None  # a non-streaming backend reports ttft 0: unknown, and so is e2e unless saved
    e2e = num(at("e2els"), f"{where}: e2els")
    if e2e is None:
        e2e = num(at("latencies"), f"{where}: latencies")
    if e2e is None and ttft is not None:
        e2e = ttft + sum(itl)
    rec = derive_request(RequestRecord(
        request_id=rid, arrival_s=arrival, ttft_s=ttft, e2e_s=e2e, itl_s=itl or None,
        prompt_tokens=prompt, output_tokens=out_len, status="ok",
    ))
    if not keep_itl and rec.itl_s is not None:  # percentiles were derived from the gaps first
        rec = dataclasses.replace(rec, itl_s=None)
    return rec


def _origin(run: dict[str, Any]) -> float | None:
    st = [x for x in (run.get("start_times") or []) if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return min(st) if st else None


def read(paths: list[Path], options: dict[str, Any]) -> Imported:
    opts = parse_options(NAME, options, {"itl": (bool, True)})
    first = _runs(paths[0])  # read now: a bad file fails before anything is written
    run0 = first[0] if first else {}
    notes: list[str] = []

    def records() -> Iterator[RequestRecord]:
        # start_times are time.perf_counter() values (CLOCK_MONOTONIC): runs on one host share the
        # origin, so every run is placed against the first run that has them
        origin = None
        many = len(paths) > 1
        for n, path in enumerate(paths):
            runs = first if n == 0 else _runs(path)
            for k, run in enumerate(runs):
                if origin is None:
                    origin = _origin(run)
                prefix = (f"{path.stem}/" if many else "") + (f"run{k + 1}/" if len(runs) > 1 else "")
                for i in range(len(run["input_lens"])):
                    yield _request(path, k + 1, run, i, f"{prefix}{i}", origin, opts["itl"])
        if origin is None:
            notes.append("no start_times in the result (vLLM before they were saved): request arrivals "
                         "unknown, time-based views are unavailable")

    models = {r.get("model_id") for r in first if isinstance(r.get("model_id"), str) and r.get("model_id")}
    if len(models) > 1:
        notes.append(f"runs use several models ({', '.join(sorted(models))}); meta.model is the first")
    bench = {k: run0[k] for k in _RUN_META if k in run0}
    model = run0.get("model_id") if isinstance(run0.get("model_id"), str) else None
    meta = CaptureMeta(clock="relative", origin=f"import:{NAME}", model=model,
                       arrivals_known=_origin(run0) is not None,
                       config={"benchmark": {"tool": "vllm bench serve", **bench}} if bench else {})
    return Imported(meta=meta, records=records(), notes=notes)
