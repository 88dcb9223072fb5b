"""Captures: an append-only folder of JSON Lines streams (see docs/capture-format.md).

The writers (CaptureWriter, QueuedWriter, from_records) are imported on first use: reading a
capture, which is all a diagnosis does, does not load them."""
from .columns import Capture, Columns, EngineSeries, time_slice
from .reader import load, load_meta
from .segment_reader import read_dicts

#: name -> the module in this package that defines it, imported when the name is first asked for
_ON_FIRST_USE = {"CaptureWriter": "writer", "kind_of": "writer", "QueuedWriter": "queued", "from_records": "memory"}

__all__ = ["Capture", "CaptureWriter", "Columns", "EngineSeries", "QueuedWriter", "from_records", "kind_of", "load",
           "load_meta", "read_dicts", "time_slice"]


def __getattr__(name: str):
    module = _ON_FIRST_USE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)
