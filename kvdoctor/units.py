"""Numbers and text as people read them, one place for every renderer (text, Markdown, HTML,
compare, on-call, the sidecar): a value in its unit, a span of time, text safe for a terminal."""
from __future__ import annotations

import math


def fmt(value: float | None, unit: str) -> str:
    """A signal value in the unit people read it in."""
    if value is None or (isinstance(value, float) and (math.isnan(value) or math.isinf(value))):
        return "n/a"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit in ("fraction",):
        return f"{value * 100:.0f}%"
    if unit == "fraction/turn":
        return f"{value * 100:+.1f}%/turn"
    if unit == "fraction/min":
        return f"{value * 100:+.1f}%/min"
    if unit == "bytes":
        return f"{value / 2**30:.2f} GiB"
    if unit == "bool":
        return "yes" if value else "no"
    if unit in ("count", "requests", "turns", "tokens"):
        return f"{value:,.0f}" + ("" if unit == "count" else f" {unit}")
    if unit == "rank corr":
        return f"{value:.2f} (rank corr)"
    if unit == "ratio":
        return f"{value:.1f}x"
    return f"{value:,.2f} {unit}"


def duration_text(s: float) -> str:
    """A span for people: '45 s', '12.5 min', '3.2 h' (text, report and compare pages)."""
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


#: control characters a terminal would execute (tab and newline kept)
_CONTROL = {c: None for c in [*range(0, 9), *range(11, 32), *range(127, 160)]}


def printable(text: str) -> str:
    """``text`` without the control characters a terminal would execute (tab and newline kept).
    JSON output is unaffected: JSON encoders escape control characters inside strings."""
    return text.translate(_CONTROL)
