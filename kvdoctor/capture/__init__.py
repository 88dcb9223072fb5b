"""Captures: an append-only folder of JSON Lines streams (see docs/capture-format.md)."""
from .reader import Capture, Columns, EngineSeries, load
from .writer import CaptureWriter

__all__ = ["Capture", "CaptureWriter", "Columns", "EngineSeries", "load"]
