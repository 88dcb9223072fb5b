"""Instants and durations as people type them: epoch seconds or ISO 8601 (a time without a
zone is UTC); 500ms, 30s, 5m, 2h, 1d, 1w. The command line's parsers for both live here
(kvdoctor/cli/params.py wraps them as click types, so an error names the option), and instants
as kvdoctor writes them (:func:`iso_utc`)."""
from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

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
    except (ValueError, OverflowError):
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()


#: a bare number of seconds (``1.5``, ``90``): what a duration option takes without a unit
_BARE = re.compile(r"^[-+]?(\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$")


def parse_seconds(text: str | float) -> float:
    """Seconds in ``500ms``, ``30s``, ``5m``, ``2h`` or a bare number of seconds (``1.5``): every
    duration option of every command. ValueError for anything else, a negative, NaN or infinite
    value (the caller names the option and its own bounds)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip()
        m = DURATION.match(s)
        if m:
            value = float(m[1]) * _UNIT_S[m[2]]
        elif _BARE.match(s):
            value = float(s)
        else:
            raise ValueError("expected a duration like 30s, 5m, 500ms or a number of seconds (1.5)")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("expected a finite duration")
    if value < 0:
        raise ValueError("expected a duration of 0 or more, not a negative one")
    return value


@dataclass(frozen=True)
class Instant:
    """A point in time as typed: absolute (epoch seconds or ISO 8601), a duration ago (``2h``:
    before now, or offline before the capture's end), or ``+DURATION`` after a capture's start."""

    text: str
    epoch_s: float | None = None
    ago_s: float | None = None
    after_start_s: float | None = None

    def resolve(self, start_s: float | None, end_s: float) -> float:
        """Epoch seconds, relative ones against [start_s, end_s] (a capture's, or now's for ``ago``)."""
        if self.epoch_s is not None:
            return self.epoch_s
        if self.ago_s is not None:
            return end_s - self.ago_s
        return (start_s if start_s is not None else end_s) + (self.after_start_s or 0.0)

    @property
    def absolute(self) -> bool:
        return self.epoch_s is not None

    def __str__(self) -> str:
        return self.text


def parse_instant(text: str) -> Instant:
    """``2026-11-30T08:00:00Z``, ``1764489600`` (epoch seconds), ``now``, ``2h`` (that long ago) or
    ``+10m`` (that long after the start); ValueError otherwise."""
    s = str(text).strip()
    if s == "now":
        return Instant(s, ago_s=0.0)
    if s.startswith("+"):
        return Instant(s, after_start_s=parse_seconds(s[1:]))
    if DURATION.match(s):
        return Instant(s, ago_s=parse_duration(s))
    t = epoch_or_iso(s)
    if t is None or t != t or t in (float("inf"), float("-inf")):
        raise ValueError("expected epoch seconds or an ISO time (2026-11-30T08:00:00Z), a duration ago (2h) or "
                         "+DURATION after the start (+10m)")
    return Instant(s, epoch_s=t)


def iso_utc(t: float) -> str:
    """Epoch seconds as ISO 8601 UTC to the second, the one way kvdoctor writes an instant:
    ``2026-11-30T10:37:10Z``."""
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
