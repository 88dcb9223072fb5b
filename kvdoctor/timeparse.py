"""Instants and durations as people type them: epoch seconds or ISO 8601 (a time without a
zone is UTC); 500ms, 30s, 5m, 2h, 1d, 1w. And instants as kvdoctor writes them (:func:`iso_utc`)."""
from __future__ import annotations

import datetime as dt
import re

DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)$")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds in ``30s``, ``5m``, ``2h``…; ValueError otherwise (the caller names the option)."""
    m = DURATION.match(text.strip())
    if not m:
        raise ValueError(f"expected a duration like 30s, 2m or 1h, got {text!r}")
    return float(m[1]) * _UNIT_S[m[2]]


def epoch_or_iso(value: str) -> float | None:
    """Epoch seconds for ``value``, or None when it is neither a number nor an ISO time (the
    caller words the error, since it knows which option or field was wrong)."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()


def iso_utc(t: float) -> str:
    """Epoch seconds as ISO 8601 UTC to the second, the one way kvdoctor writes an instant:
    ``2026-11-30T10:37:10Z``."""
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
