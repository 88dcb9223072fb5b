"""Signals: named, unit-tagged numbers computed from a capture window.

Every signal is registered in :data:`REGISTRY` (name, unit, docstring, function); rules refer
to them by name. `kvdoctor signals` lists them.
"""
from . import config, decode, harm, host, interference, latency, load, memory, outcomes, sessions  # noqa: F401  (modules register their signals)
from .registry import REGISTRY, Signal, signal
from .prepared import Prepared
from .window import Window

__all__ = ["REGISTRY", "Prepared", "Signal", "Window", "signal"]
