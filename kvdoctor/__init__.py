"""kvdoctor: find out why an LLM inference service is slow or falling over, and what to change.

The library is the product; the CLI, the sidecar and the report are thin shells over it::

    import kvdoctor
    from kvdoctor.diagnosis import diagnose

    cap = kvdoctor.load("samples/multi-turn")
    result = diagnose(cap)  # a Diagnosis: result.incidents, most severe first
"""
__version__ = "0.1.0"

from .capture import Capture, CaptureWriter, load  # noqa: E402

__all__ = ["Capture", "CaptureWriter", "load", "__version__"]
