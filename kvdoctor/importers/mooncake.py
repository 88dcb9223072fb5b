"""Mooncake request traces (kvcache-ai/Mooncake, FAST'25 release): JSON Lines, one request a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

Mapping: ``timestamp`` (ms from the trace start) -> arrival_s (relative clock), ``input_length`` ->
prompt_tokens, ``output_length`` -> output_tokens, ``hash_ids`` -> prefix_block_hashes with
prefix_block_tokens = 512 (``--opt block_tokens=N`` for other traces). Equal ids in two requests mean
an equal prompt prefix up to that block, which is what prefix-cache analysis needs. The trace is a
workload (what was asked, when); it holds no latencies.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from ..capture.jsonl import json_lines
from ..errors import InputError
from ..model import CaptureMeta, RequestRecord, derive_request
from . import describe, integer, num, parse_options, request_id_for
from .base import Imported

NAME = "mooncake"
SUMMARY = "Mooncake trace JSONL (timestamp ms, input_length, output_length, hash_ids of 512-token blocks)"
GLOB = "*.jsonl"
OPTIONS = {
    "block_tokens": "tokens per hash_ids block (default 512, Mooncake's)",
    "time_unit": "unit of timestamp: ms (default) or s",
}
_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}


def _record(path: Path, n: int, obj: Any, rid: str, scale: float, block_tokens: int) -> RequestRecord:
    where = f"{path}: line {n}"
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object with timestamp, input_length, output_length, hash_ids")
    for key in ("timestamp", "input_length"):
        if key not in obj:
            raise InputError(f"{where}: field {key} missing; expected timestamp (ms), input_length, output_length, hash_ids")
    hashes = obj.get("hash_ids")
    if hashes is not None:
        if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                                   and -(1 << 63) <= h < (1 << 64) for h in hashes):
            raise InputError(f"{where}: field hash_ids: expected a list of 64-bit integers, got {describe(hashes)}")
    return derive_request(RequestRecord(
        request_id=rid,
        arrival_s=num(obj["timestamp"], f"{where}: field timestamp", allow_none=False) * scale,
        prompt_tokens=integer(obj["input_length"], f"{where}: field input_length", allow_none=False),
        output_tokens=integer(obj.get("output_length"), f"{where}: field output_length"),
        prefix_block_hashes=hashes or None,
        prefix_block_tokens=block_tokens if hashes else None,
    ))


def read(paths: list[Path], options: dict[str, Any]) -> Imported:
    opts = parse_options(NAME, options, {"block_tokens": (int, 512), "time_unit": (str, "ms")})
    if opts["time_unit"] not in _UNITS:
        raise InputError(f"--opt time_unit={opts['time_unit']}: expected one of {', '.join(_UNITS)}")
    if opts["block_tokens"] <= 0:
        raise InputError(f"--opt block_tokens={opts['block_tokens']}: expected a positive whole number")
    scale = _UNITS[opts["time_unit"]]
    for p in paths:  # fail on an unreadable file before writing anything
        if not p.is_file():
            raise InputError(f"{p}: not a file")

    def records() -> Iterator[RequestRecord]:
        for path in paths:
            for i, (n, obj) in enumerate(json_lines(path, "one Mooncake request object per line")):
                yield _record(path, n, obj, request_id_for(len(paths), path.stem, i), scale, opts["block_tokens"])

    notes = ["a workload trace: arrivals, sizes and prefix blocks only, no latencies"]
    if len(paths) > 1:
        notes.append("several traces imported: each keeps its own time origin, so they overlap in time")
    return Imported(meta=CaptureMeta(clock="relative", origin=f"import:{NAME}"), records=records(), notes=notes)
