"""kvdoctor: find out why an LLM inference service is slow or falling over, and what to change.

The library is the product; the CLI, the sidecar and the report are thin shells over it::

    import kvdoctor
    from kvdoctor.diagnosis import diagnose

    cap = kvdoctor.load("samples/multi-turn")
    result = diagnose(cap)  # a Diagnosis: result.incidents, most severe first
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Capture", "CaptureWriter", "load", "__version__"]

if TYPE_CHECKING:
    from .capture import Capture, CaptureWriter, load


def __getattr__(name: str) -> Any:
    # imported when first used: a process that needs one small part (the sidecar's /metrics
    # parse worker: kvdoctor.engines) does not load the capture layer and pyarrow (~50 MiB)
    if name in ("Capture", "CaptureWriter", "load"):
        from . import capture

        value = globals()[name] = getattr(capture, name)  # found directly from now on
        return value
    raise AttributeError(f"module 'kvdoctor' has no attribute {name!r}")
