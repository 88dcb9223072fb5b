"""Numbers and text as people read them, one place for every renderer (text, Markdown, HTML,
compare, on-call, the sidecar): a value in its unit, a span of time, text safe for a terminal; and
the one parser of sizes as people type them (every command's size options, kvdoctor/cli/params.py)."""
from __future__ import annotations

import math
import re


def fmt(value: float | None, unit: str) -> str:
    """A value in the unit people read it in ("5.31 s", "45 ms", "12%", "3.2x", "0.94 req/s",
    "1,243 tokens"): the one formatter of every renderer (text, Markdown, HTML, compare, fleet)."""
    if value is None or (isinstance(value, float) and (math.isnan(value) or math.isinf(value))):
        return "n/a"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if unit == "fraction":
        return f"{value * 100:.0f}%" if abs(value) >= 0.01 or value == 0 else f"{value * 100:.1f}%"
    if unit in ("fraction/turn", "fraction/min"):
        return f"{value * 100:+.1f}%/{unit.split('/')[1]}"
    if unit == "ratio":
        return f"{value:.1f}x" if abs(value) < 100 else f"{value:,.0f}x"
    if unit == "x budget":
        return f"{value:.1f}x the budget"
    if unit == "bool":
        return "yes" if value else "no"
    if unit in ("count", "requests"):
        return f"{value:,.0f}"
    if unit in ("tokens", "turns"):
        return f"{value:,.0f} {unit}"
    if unit == "tokens/turn":
        return f"{value:,.0f} tokens/turn"
    if unit == "rank corr":
        return f"{value:.2f}"
    if unit == "z":
        return f"z {value:.1f}"
    if unit == "1/s":
        return f"{value:,.2f} req/s"
    if unit == "tokens/s":
        return f"{value:,.1f} tok/s" if abs(value) < 100 else f"{value:,.0f} tok/s"
    if unit == "1/min":
        return f"{value:,.2f}/min"
    if unit == "ms/1k tokens":
        return f"{value:,.0f} ms per 1k tokens"
    if unit == "bytes":
        return f"{value / 2**30:.2f} GiB"
    if unit == "min":
        return f"{value:,.0f} min"
    return f"{value:,.2f} {unit}" if unit else (f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}")


def target_text(value: float, unit: str) -> str:
    """An objective's target as people write it: "2 s", "100 ms", "1%" (no trailing zeros)."""
    if unit == "s":
        return f"{value * 1000:g} ms" if value < 1 else f"{value:g} s"
    if unit == "fraction":
        return f"{value * 100:g}%"
    return fmt(value, unit)


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


#: size units as people type them: KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary, and a bare K/M/G/T
#: binary (what `free -g`, Kubernetes' Gi and engine logs mean by it); B or nothing: bytes
SIZE_UNITS: dict[str, float] = {"": 1, "b": 1, "k": 2**10, "kb": 1e3, "kib": 2**10, "ki": 2**10, "m": 2**20, "mb": 1e6,
                                "mib": 2**20, "mi": 2**20, "g": 2**30, "gb": 1e9, "gib": 2**30, "gi": 2**30,
                                "t": 2**40, "tb": 1e12, "tib": 2**40, "ti": 2**40}
_SIZE = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*([a-z]*)\s*")


def parse_size(text: str | float) -> float:
    """Bytes in ``1GiB``, ``512MiB``, ``80GB`` or a bare number of bytes: every size option of
    every command. ValueError for another unit, a negative, NaN or infinite value (the caller
    names the option and its own bounds)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _SIZE.fullmatch(str(text).lower())
        if not m or m[2] not in SIZE_UNITS:
            raise ValueError("expected a size like 1GiB, 512MiB, 80GB or a number of bytes")
        value = float(m[1]) * SIZE_UNITS[m[2]]
    if not math.isfinite(value):
        raise ValueError("expected a finite size")
    if value < 0:
        raise ValueError("expected a size of 0 or more, not a negative one")
    return value
