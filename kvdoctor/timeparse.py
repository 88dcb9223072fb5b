"""Instants as people type them: epoch seconds or ISO 8601 (a time without a zone is UTC)."""
from __future__ import annotations

import datetime as dt


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
