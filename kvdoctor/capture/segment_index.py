"""Which segments a time range needs.

``CaptureWriter`` appends a line to ``segments.idx`` as it closes a segment: the segment's name,
its size in bytes, its record count and the earliest and latest time any of its records carries
(a request's arrival or finish, a sample's time). A reader asked for a time range (``--since``,
``--until``) reads only the segments whose span meets the range, so a week of one replica costs
what the hour asked for. The index only ever saves work: a segment it does not vouch for (the
open one of a running sidecar, one whose size changed since, an older capture's, a torn or
foreign line) is read in full, and the records read are cut to the range exactly afterwards.
"""
from __future__ import annotations

import re
from pathlib import Path

import orjson

INDEX_NAME = "segments.idx"
#: the record fields whose times bound a segment
TIME_FIELDS = ("arrival_s", "finish_s", "time_s")
_SEGMENT = re.compile(r"^[a-z]+-\d{6}\.jsonl$")


def read_index(folder: Path) -> dict[str, tuple[float, float]]:
    """segment name -> (earliest, latest) time of its records, for each segment the index vouches
    for: named like a segment, still there, and the size it had when it was indexed."""
    try:
        data = (folder / INDEX_NAME).read_bytes()
    except OSError:
        return {}
    out: dict[str, tuple[float, float]] = {}
    for line in data.splitlines():
        try:
            e = orjson.loads(line)
            name, size, lo, hi = e["segment"], e["bytes"], float(e["min_s"]), float(e["max_s"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a torn or foreign line: its segment is read in full
        if not isinstance(name, str) or not _SEGMENT.match(name) or not lo <= hi:
            continue
        try:
            if (folder / name).stat().st_size != size:
                continue
        except OSError:
            continue
        out[name] = (lo, hi)
    return out


def overlaps(span: tuple[float, float], lo: float | None, hi: float | None) -> bool:
    return (lo is None or span[1] >= lo) and (hi is None or span[0] <= hi)
