"""kvdoctor: find out why an LLM inference service is slow or falling over, and what to change.

The library is the product; the CLI, the sidecar and the report are thin shells over it::

    import kvdoctor
    cap = kvdoctor.load("samples/multi-turn")
    result = kvdoctor.diagnose(cap)
"""
__version__ = "0.1.0"

from .capture import Capture, CaptureWriter, load  # noqa: E402

__all__ = ["Capture", "CaptureWriter", "load", "__version__"]
