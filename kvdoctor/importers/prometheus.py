"""Prometheus text snapshots of an engine's ``/metrics`` (``curl -s host/metrics > t0.prom``).

Each file is one scrape. Engines are recognised by metric name (vLLM, SGLang, TGI, llama.cpp,
TensorRT-LLM, DCGM exporter; several may share a file) and mapped to engine-neutral names
(see docs/engines.md). Each scrape becomes one ``EngineSample``; the configuration the metrics
reveal (KV block size and count, capacity, model, ...) becomes an ``Event(kind="config")`` at
the first scrape and again whenever it changes, and the capture's meta.

Time of each scrape: with ``--opt interval_s=N`` the files are taken in the order given (a
folder's files sorted by name) at ``start_s + i*N`` (relative clock unless ``start_s`` is an
epoch time); without it the files are ordered by modification time and stamped with it (unix
clock). For llama.cpp, ``--opt props=props.json`` and ``--opt slots=slots.json`` (saved from
``/props`` and ``/slots``) add context size, slot count and model to the config.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import orjson

from ..engines import llamacpp_config_from_props, parse_scrape
from ..errors import InputError
from ..model import CaptureMeta, EngineSample, Event, SourceStatus
from . import parse_options
from .base import Imported

NAME = "prometheus"
SUMMARY = "Prometheus text scrapes of /metrics (vLLM, SGLang, TGI, llama.cpp, TensorRT-LLM, DCGM), one file per scrape"
GLOB = ("*.prom", "*.txt", "*.metrics")
OPTIONS = {
    "interval_s": "seconds between scrapes, files taken in the order given (default: file mtimes)",
    "start_s": "time of the first scrape with interval_s (default 0, relative clock; an epoch time gives a unix clock)",
    "server": "server name to record on every sample",
    "props": "llama.cpp /props JSON file, for context size, slots and model",
    "slots": "llama.cpp /slots JSON file, for per-slot context size",
}
UNKNOWN = ("no metrics of a known engine (vLLM, SGLang, TGI, llama.cpp, TensorRT-LLM, DCGM) found; "
           "expected Prometheus text from /metrics")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None


def _read_json(name: str, value: str | None, kind: type) -> Any:
    if not value:
        return None
    path = Path(value)
    try:
        obj = orjson.loads(path.read_bytes())
    except OSError as e:
        raise InputError(f"--opt {name}={value}: cannot read ({e.strerror})") from None
    except orjson.JSONDecodeError as e:
        raise InputError(f"--opt {name}={value}: not valid JSON ({e.msg}); expected the body of GET /{name}") from None
    if not isinstance(obj, kind):
        raise InputError(f"--opt {name}={value}: expected a JSON {'object' if kind is dict else 'array'} "
                         f"as GET /{name} returns")
    return obj


def _times(paths: list[Path], interval: float | None, start: float) -> list[tuple[Path, float]]:
    if interval is not None:
        if interval <= 0:
            raise InputError(f"--opt interval_s={interval}: expected a positive number of seconds")
        return [(p, start + i * interval) for i, p in enumerate(paths)]
    stamped = []
    for p in paths:
        try:
            stamped.append((p, p.stat().st_mtime))
        except OSError as e:
            raise InputError(f"{p}: cannot read ({e.strerror})") from None
    return sorted(stamped, key=lambda pt: pt[1])


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != "raw"}


def read(paths: list[Path], options: dict[str, Any]) -> Imported:
    opts = parse_options(NAME, options, {"interval_s": (float, None), "start_s": (float, 0.0), "server": (str, None),
                                         "props": (str, None), "slots": (str, None)})
    if not paths:
        raise InputError("no files given; expected one or more Prometheus text scrapes of /metrics")
    extra = {}
    props, slots = _read_json("props", opts["props"], dict), _read_json("slots", opts["slots"], list)
    if props is not None or slots is not None:
        extra = llamacpp_config_from_props(props, slots)
    server = opts["server"]
    scrapes: list[tuple[EngineSample, dict[str, Any]]] = []
    for path, t in _times(paths, opts["interval_s"], opts["start_s"]):
        sample, config, engine = parse_scrape(_read_text(path), t, server=server, source=str(path))
        if engine is None:
            raise InputError(f"{path}: {UNKNOWN}")
        for k, v in extra.items():
            config.setdefault(k, v)
        scrapes.append((sample, config))

    engines = Counter(s.engine for s, _ in scrapes)
    engine = engines.most_common(1)[0][0]
    first = scrapes[0][1]
    clock = "relative" if opts["interval_s"] is not None and opts["start_s"] < 1e9 else "unix"

    def records() -> Iterator[Any]:
        last = None
        for sample, config in scrapes:
            if config and _comparable(config) != last:
                last = _comparable(config)
                yield Event(time_s=sample.time_s, kind="config", server=server, detail=config)
            yield sample

    detail = f"{len(scrapes)} scrape(s); engines: {', '.join(sorted(engines))}"
    meta = CaptureMeta(clock=clock, engine=engine, model=first.get("model"), gpu=first.get("gpu_name"),
                       server=server, origin=f"import:{NAME}", config=first,
                       sources={NAME: SourceStatus(ok=True, detail=detail)})
    notes = []
    if len(scrapes) == 1:
        notes.append("one scrape only: counters and histograms give totals since the server started, not rates")
    if len(engines) > 1:
        notes.append(f"scrapes from different engines: {', '.join(sorted(engines))}")
    return Imported(meta=meta, records=records(), notes=notes)
