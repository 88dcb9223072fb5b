"""The kinds of value the commands take, as click types: each parses with the one parser of its
kind (durations and times in kvdoctor/timeparse.py, sizes in kvdoctor/units.py) and a bad value
is a one-line error naming the option (exit 2), before anything is read or written.

Every option of every command has one of these types, or a click type with bounds (IntRange,
FloatRange, Choice, Path); tests/test_cli_options.py walks the command tree and feeds each of
them bad values of its kind.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import click

#: the Prometheus query timeout every command that reads Prometheus uses by default
PROM_TIMEOUT = "60s"


class Duration(click.ParamType):
    """``30s``, ``5m``, ``500ms`` or a bare number of seconds -> float seconds, within bounds."""

    name = "duration"

    def __init__(self, min_s: float = 0.0, max_s: float = 366 * 86400.0, *, zero_ok: bool = False):
        self.min_s, self.max_s, self.zero_ok = min_s, max_s, zero_ok

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "DURATION"

    def convert(self, value: Any, param, ctx) -> float:
        from ..timeparse import parse_seconds

        try:
            s = parse_seconds(value)
        except ValueError as e:
            self.fail(f"{_shown(value)}: {e}", param, ctx)
        if s == 0 and not self.zero_ok:
            self.fail(f"{_shown(value)}: expected a duration above 0", param, ctx)
        if s and s < self.min_s:
            self.fail(f"{_shown(value)}: expected at least {self.min_s:g} s", param, ctx)
        if s > self.max_s:
            self.fail(f"{_shown(value)}: expected at most {_span(self.max_s)}", param, ctx)
        return s


class PromDuration(Duration):
    """A duration kept as PromQL writes it (``5m``; a bare number of seconds becomes ``300s``)."""

    def convert(self, value: Any, param, ctx) -> str:
        seconds = super().convert(value, param, ctx)
        text = str(value).strip()
        from ..timeparse import DURATION as UNIT_FORM

        if UNIT_FORM.match(text) and not text.endswith("w") and "." not in text:
            return text
        return f"{seconds * 1000:.0f}ms" if seconds != int(seconds) else f"{int(seconds)}s"


class Size(click.ParamType):
    """``1GiB``, ``512MiB``, ``80GB`` or a bare number of bytes -> int bytes, within bounds."""

    name = "size"

    def __init__(self, min_bytes: float = 1, max_bytes: float = 2.0**50):
        self.min_bytes, self.max_bytes = min_bytes, max_bytes

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "SIZE"

    def convert(self, value: Any, param, ctx) -> int:
        from ..units import parse_size

        try:
            b = parse_size(value)
        except ValueError as e:
            self.fail(f"{_shown(value)}: {e}", param, ctx)
        if b < self.min_bytes:
            lowest = "above 0" if self.min_bytes <= 1 else f"at least {_bytes(self.min_bytes)}"
            self.fail(f"{_shown(value)}: expected a size {lowest}", param, ctx)
        if b > self.max_bytes:
            self.fail(f"{_shown(value)}: expected at most {_bytes(self.max_bytes)}", param, ctx)
        return int(b)


class Count(click.ParamType):
    """A whole number within bounds (``32768``, ``1e5`` when whole), said in the option's unit."""

    name = "integer"

    def __init__(self, lo: int, hi: int, unit: str = ""):
        self.lo, self.hi, self.unit = lo, hi, unit

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "N"

    def convert(self, value: Any, param, ctx) -> int:
        try:
            f = float(value)
            ok = math.isfinite(f) and f == int(f)
        except (TypeError, ValueError, OverflowError):
            ok = False
        unit = f" {self.unit}" if self.unit else ""
        if not ok or not self.lo <= f <= self.hi:
            self.fail(f"{_shown(value)}: expected a whole number{unit} from {self.lo:,} to {self.hi:,}", param, ctx)
        return int(f)


class Time(click.ParamType):
    """An instant: ISO 8601, epoch seconds, ``now``, a duration ago (``2h``) or ``+DURATION``
    after the start -> kvdoctor.timeparse.Instant (resolved against a capture or now later)."""

    name = "time"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "TIME"

    def convert(self, value: Any, param, ctx):
        from ..timeparse import Instant, parse_instant

        if isinstance(value, Instant):
            return value
        try:
            return parse_instant(value)
        except ValueError as e:
            self.fail(f"{_shown(value)}: {e}", param, ctx)


class Address(click.ParamType):
    """``HOST:PORT``, ``PORT`` or ``HOST`` (a default port) to listen on; kept as typed."""

    name = "address"

    def __init__(self, default_port: int):
        self.default_port = default_port

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "HOST:PORT"

    def convert(self, value: Any, param, ctx) -> str:
        from ..errors import InputError
        from ..sidecar.agent import host_port

        try:
            host, _ = host_port(str(value), self.default_port, "")
        except InputError as e:
            self.fail(f"{_shown(value)}: {str(e).split(': ', 1)[-1]}", param, ctx)
        try:
            host.encode("idna")
        except UnicodeError:
            self.fail(f"{_shown(value)}: {_shown(host)} is not a host name or address", param, ctx)
        return str(value).strip()


class Url(click.ParamType):
    """An http(s) URL with a host."""

    name = "url"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "URL"

    def convert(self, value: Any, param, ctx) -> str:
        from urllib.parse import urlparse

        text = str(value).strip()
        try:
            u = urlparse(text)
            u.port  # noqa: B018  (raises ValueError on a port out of range)
        except ValueError:
            u = None
        if u is None or u.scheme not in ("http", "https") or not u.hostname or not _printable_ascii(text):
            self.fail(f"{_shown(value)}: expected an http(s):// URL such as http://127.0.0.1:8000", param, ctx)
        return text


class Engine(click.ParamType):
    """An engine name kvdoctor knows the knobs of (kvdoctor.engines.labels.ENGINE_KNOB) -> its key."""

    name = "engine"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "ENGINE"

    def convert(self, value: Any, param, ctx) -> str:
        from ..engines.labels import ENGINE_KNOB

        key = str(value).strip().lower()
        if key not in ENGINE_KNOB:
            self.fail(f"{_shown(value)}: expected one of {', '.join(ENGINE_KNOB)}", param, ctx)
        return ENGINE_KNOB[key]


class Gpu(click.ParamType):
    """A GPU name with a known memory size and bandwidth (decode's bound is estimated from it)."""

    name = "gpu"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "GPU"

    def convert(self, value: Any, param, ctx) -> str:
        from ..plan.models import GPU_MEM_BW, gpu_bandwidth

        hit = gpu_bandwidth(str(value)) if str(value).strip() else None
        if hit is None:
            self.fail(f"{_shown(value)}: not a GPU with a known memory bandwidth; expected one of "
                      f"{', '.join(GPU_MEM_BW)}", param, ctx)
        return hit[0]


class Share(click.FloatRange):
    """A number within bounds (a share, a fraction); NaN and infinities refused (click's
    FloatRange lets NaN through: every comparison with it is false)."""

    def convert(self, value: Any, param, ctx) -> float:
        f = super().convert(value, param, ctx)
        if not math.isfinite(f):
            self.fail(f"{_shown(value)}: expected a finite number", param, ctx)
        return f


class Objective(click.ParamType):
    """``--slo NAME=VALUE``: checked by kvdoctor.objectives (name, unit, range); kept as typed."""

    name = "objective"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "NAME=VALUE"

    def convert(self, value: Any, param, ctx) -> str:
        from ..errors import InputError
        from ..objectives import parse_slo

        try:
            parse_slo([value])
        except InputError as e:
            self.fail(str(e).removeprefix("--slo "), param, ctx)
        return str(value)


class Selector(click.ParamType):
    """PromQL label matchers, ``'{job="vllm"}'``: checked by the fleet query builder; kept as typed."""

    name = "selector"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "'{job=\"vllm\"}'"

    def convert(self, value: Any, param, ctx) -> str:
        from ..errors import InputError
        from ..prometheus.query import selector_matchers

        try:
            selector_matchers(str(value))
        except InputError as e:
            self.fail(f"{_shown(value)}: {str(e).split(': ', 1)[-1]}", param, ctx)
        return str(value)


class Labels(click.ParamType):
    """Prometheus label names, comma separated (``pod,model_name``)."""

    name = "labels"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "LABELS"

    def convert(self, value: Any, param, ctx) -> str:
        import re

        names = [x.strip() for x in str(value).split(",")]
        if not names or not all(re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", n) for n in names):
            self.fail(f"{_shown(value)}: expected label names separated by commas, e.g. instance or pod,model_name",
                      param, ctx)
        return ",".join(names)


class UserPass(click.ParamType):
    """``USER:PASS`` for HTTP basic auth."""

    name = "user:pass"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "USER:PASS"

    def convert(self, value: Any, param, ctx) -> str:
        text = str(value)
        if ":" not in text or not text.split(":", 1)[0] or not _printable_ascii(text.replace(" ", "x")):
            self.fail("expected USER:PASS (printable ASCII)", param, ctx)
        return text


class InputFile(click.Path):
    """A file (or folder) that must exist and be readable; the error names the option."""

    def __init__(self, *, dir_okay: bool = False, file_okay: bool = True):
        super().__init__(exists=True, dir_okay=dir_okay, file_okay=file_okay, readable=True)


class OutputFile(click.ParamType):
    """A file to write: not a folder, and in a folder that exists (nothing is created on the
    way); ``-`` is standard output where the command allows it."""

    name = "file"

    def __init__(self, dash_ok: bool = False):
        self.dash_ok = dash_ok

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "FILE"

    def convert(self, value: Any, param, ctx) -> str:
        text = os.fspath(value)
        if text == "-" and self.dash_ok:
            return text
        if not text.strip():
            self.fail("empty; expected a file name", param, ctx)
        p = Path(text)
        if p.is_dir():
            self.fail(f"{_shown(text)}: is a folder; expected a file name (e.g. {p / 'out'})", param, ctx)
        parent = p.parent
        if not parent.is_dir():
            self.fail(f"{_shown(text)}: no folder {_shown(str(parent))}; create it first", param, ctx)
        if not os.access(parent, os.W_OK):
            self.fail(f"{_shown(text)}: folder {_shown(str(parent))} is not writable", param, ctx)
        return text


class OutputFolder(click.ParamType):
    """A folder to write into (created when missing): not an existing file, and its parent must
    exist or be creatable."""

    name = "folder"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "FOLDER"

    def convert(self, value: Any, param, ctx) -> str:
        text = os.fspath(value)
        if not text.strip():
            self.fail("empty; expected a folder name", param, ctx)
        p = Path(text)
        if p.exists() and not p.is_dir():
            self.fail(f"{_shown(text)}: exists and is not a folder", param, ctx)
        anc = p
        while not anc.exists():
            anc = anc.parent
        if not anc.is_dir():
            self.fail(f"{_shown(text)}: {_shown(str(anc))} is a file, not a folder", param, ctx)
        if not os.access(anc, os.W_OK):
            self.fail(f"{_shown(text)}: {_shown(str(anc))} is not writable", param, ctx)
        return text


DURATION = Duration()
SIZE = Size()
TIME = Time()
URL = Url()
ENGINE = Engine()
GPU = Gpu()
OBJECTIVE = Objective()
#: token counts: a context length or a request's length (the longest served today is ~10M)
TOKENS = Count(1, 100_000_000, "of tokens")


def _shown(value: Any, limit: int = 60) -> str:
    s = repr(os.fspath(value) if isinstance(value, os.PathLike) else value)
    return s if len(s) <= limit else s[: limit - 4] + "...'"


def _printable_ascii(text: str) -> bool:
    return all(32 < ord(c) < 127 for c in text)


def _span(s: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n and s % n == 0:
            return f"{s / n:g}{unit}"
    return f"{s:g}s"


def _bytes(b: float) -> str:
    for unit, n in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= n:
            return f"{b / n:g} {unit}"
    return f"{b:g} bytes" if not math.isinf(b) else "any size"
