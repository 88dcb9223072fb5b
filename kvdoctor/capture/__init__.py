"""Captures: an append-only folder of JSON Lines streams (see docs/capture-format.md)."""
from .columns import Capture, Columns, EngineSeries, time_slice
from .memory import from_records
from .queued import QueuedWriter
from .reader import load, load_meta
from .segment_reader import read_dicts
from .writer import CaptureWriter, kind_of

__all__ = ["Capture", "CaptureWriter", "Columns", "EngineSeries", "QueuedWriter", "from_records", "kind_of", "load",
           "load_meta", "read_dicts", "time_slice"]
