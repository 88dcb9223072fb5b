"""The two sides of a comparison: a capture folder, or a time range of one.

    cap/                       the whole capture
    cap@1767000000..1767000600 epoch seconds
    cap@2026-11-30T08:00:00Z..2026-11-30T09:00:00Z
    cap@+0..+300               seconds from the capture's first record
    cap@+300..                 open-ended (either bound may be left out)

A folder whose own name contains ``@`` is read as a folder when it exists.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from ..capture import Capture, load
from ..errors import InputError
from ..timeparse import epoch_or_iso

SYNTAX = "CAPTURE or CAPTURE@T1..T2 (T: epoch seconds, ISO 8601, or +SECONDS from the capture start)"


@dataclass(frozen=True)
class SideSpec:
    text: str
    path: Path
    since: str | None = None
    until: str | None = None

    @property
    def ranged(self) -> bool:
        return self.since is not None or self.until is not None


def parse_side(text: str, role: str = "side") -> SideSpec:
    """Split ``CAPTURE[@T1..T2]``; InputError (one line) on bad syntax."""
    if not text or not text.strip():
        raise InputError(f"{role}: empty; expected {SYNTAX}")
    if "@" not in text or Path(text).is_dir():
        return SideSpec(text, Path(text))
    path, _, rng = text.rpartition("@")
    m = re.fullmatch(r"(.*?)\.\.(.*)", rng)
    if not path or not m:
        raise InputError(f"{role} {text!r}: expected {SYNTAX}, e.g. cap@+0..+300")
    since, until = m[1].strip() or None, m[2].strip() or None
    if since is None and until is None:
        raise InputError(f"{role} {text!r}: the range names no time; expected e.g. cap@+0..+300")
    for value in (since, until):
        if value is not None:
            _parse_time(value, 0.0, role, text)  # syntax check before any loading
    return SideSpec(text, Path(path), since, until)


def _parse_time(value: str, start_s: float, role: str, text: str) -> float:
    if value.startswith("+"):
        try:
            return start_s + float(value[1:])
        except ValueError:
            raise InputError(f"{role} {text!r}: {value!r} is not +SECONDS (e.g. +300)") from None
    t = epoch_or_iso(value)
    if t is None:
        raise InputError(f"{role} {text!r}: {value!r} is not epoch seconds, an ISO time like "
                         "2026-11-30T08:00:00Z, or +SECONDS")
    return t


@dataclass
class Side:
    spec: SideSpec
    role: str
    capture: Capture
    since_s: float | None
    until_s: float | None

    @property
    def label(self) -> str:
        return self.spec.text


def load_side(spec: SideSpec | str | Path, role: str = "side") -> Side:
    """Load a side; a range is cut from the whole capture (relative times need its start)."""
    if not isinstance(spec, SideSpec):
        spec = parse_side(str(spec), role)
    if not spec.ranged:
        cap = load(spec.path)
        lo = hi = None
    else:
        cap = load(spec.path)
        start = cap.start_s if cap.start_s is not None else 0.0
        lo = _parse_time(spec.since, start, role, spec.text) if spec.since else None
        hi = _parse_time(spec.until, start, role, spec.text) if spec.until else None
        if lo is not None and hi is not None and hi <= lo:
            raise InputError(f"{role} {spec.text!r}: the range ends before it starts")
        cap = load_range(spec.path, cap, lo, hi)
    if len(cap.requests) == 0:
        where = "" if not spec.ranged else " in that range"
        raise InputError(f"{role} {spec.text!r}: no requests{where}; a comparison needs requests on both sides")
    return Side(spec, role, cap, lo, hi)


def load_range(path: Path, whole: Capture, lo: float | None, hi: float | None) -> Capture:
    """The capture cut to [lo, hi] (the reader's own slicing, so the rules see what
    `diagnose --since/--until` would)."""
    from ..capture import time_slice

    cut = time_slice(whole, lo, hi)
    return dataclasses.replace(cut, warnings=list(whole.warnings))
