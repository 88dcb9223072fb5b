"""Importers: other tools' files turned into captures (``kvdoctor import FORMAT SRC... -o CAPTURE``).

Each format is one module, imported only when used, that exposes:

* ``NAME`` and ``SUMMARY`` (one line for help),
* ``read(paths: list[Path], options: dict) -> Imported`` (see :mod:`.base`): ``options`` holds the
  ``--opt KEY=VALUE`` pairs as strings, plus ``"columns"`` (``--col FIELD=COLUMN``) for ``csv``,
* optionally ``OPTIONS`` (option name -> help) and ``GLOB`` (a pattern, or patterns tried in turn,
  for the files to take from a folder given as SRC).

Records are yielded lazily so a big file is parsed once and never held twice.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable

from ..errors import InputError

#: format name -> module, imported on first use
IMPORTERS: dict[str, str] = {
    "vllm-bench": "kvdoctor.importers.vllm_bench",
    "llmperf": "kvdoctor.importers.llmperf",
    "csv": "kvdoctor.importers.csv_import",
    "mooncake": "kvdoctor.importers.mooncake",
    "otlp-json": "kvdoctor.importers.otlp_json",
    "aiperf": "kvdoctor.importers.aiperf",
    "guidellm": "kvdoctor.importers.guidellm",
    "prometheus": "kvdoctor.importers.prometheus",
    "prometheus-range": "kvdoctor.importers.prometheus_range",  # fleet mode: Prometheus query_range API
}

_loaded: dict[str, ModuleType] = {}


def names() -> list[str]:
    return list(IMPORTERS)


def get(name: str) -> ModuleType:
    """The importer module for a format name; InputError (listing the formats) if unknown."""
    mod = _loaded.get(name)
    if mod is not None:
        return mod
    target = IMPORTERS.get(name)
    if target is None:
        raise InputError(f"unknown import format {name!r}; expected one of: {', '.join(IMPORTERS)}")
    mod = importlib.import_module(target)
    _loaded[name] = mod
    return mod


# -- small helpers the importer modules share -----------------------------------------------

def _to_bool(v: str) -> bool:
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _to_float(v: str) -> float:
    return float(v)


def _to_int(v: str) -> int:
    return int(v)


OPTION_TYPES: dict[type, Callable[[str], Any]] = {bool: _to_bool, float: _to_float, int: _to_int, str: str}


def parse_options(fmt: str, options: dict[str, Any], spec: dict[str, tuple[type, Any]],
                  *, passthrough: tuple[str, ...] = ()) -> dict[str, Any]:
    """Check ``--opt`` values against ``spec`` (name -> (type, default)); unknown names or values
    that do not convert are an InputError naming the option and what was expected."""
    out = {k: default for k, (_, default) in spec.items()}
    for key, raw in (options or {}).items():
        if key in passthrough:
            out[key] = raw
            continue
        if key not in spec:
            known = ", ".join(spec) or "none"
            raise InputError(f"--opt {key}: unknown option for format {fmt}; known options: {known}")
        typ = spec[key][0]
        if not isinstance(raw, str):
            out[key] = raw
            continue
        try:
            out[key] = OPTION_TYPES[typ](raw)
        except (ValueError, TypeError):
            expected = {bool: "true or false", int: "a whole number", float: "a number"}.get(typ, typ.__name__)
            raise InputError(f"--opt {key}={raw}: expected {expected}") from None
    return out


def describe(value: Any, limit: int = 40) -> str:
    """A short repr of a bad value for an error message."""
    s = repr(value)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def num(value: Any, where: str, *, allow_none: bool = True) -> float | None:
    """A JSON value as float; InputError naming ``where`` if it is not a number."""
    if value is None:
        if allow_none:
            return None
        raise InputError(f"{where}: missing; expected a number")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                pass
            else:
                return _finite(f, value, where)
        raise InputError(f"{where}: expected a number, got {describe(value)}")
    try:
        return _finite(float(value), value, where)
    except OverflowError:  # an integer beyond any float (10**400)
        raise InputError(f"{where}: expected a number within ±1e308, got {describe(value)}") from None


def _finite(f: float, value: Any, where: str) -> float:
    """NaN and infinities are no measurement ("Infinity" tokens, 1e999 seconds): refused where read."""
    if f != f or f in (float("inf"), float("-inf")):
        raise InputError(f"{where}: expected a finite number, got {describe(value)}")
    return f


def integer(value: Any, where: str, *, allow_none: bool = True) -> int | None:
    """A JSON value as int (2.0 is accepted; 2.5 is not)."""
    f = num(value, where, allow_none=allow_none)
    if f is None:
        return None
    if f != f or f in (float("inf"), float("-inf")) or f != int(f):
        raise InputError(f"{where}: expected a whole number, got {describe(value)}")
    return int(f)


def request_id_for(paths_count: int, stem: str, index: int) -> str:
    """Ids unique within a capture: the row index, prefixed by the file stem when several files."""
    return str(index) if paths_count == 1 else f"{stem}/{index}"
