"""`kvdoctor quality`: output quality under KV quantisation. The same long prompts, greedy
decoding, against a baseline server (e.g. f16 KV) and a candidate (e.g. q4_0 KV); per prompt, how
early the outputs diverge and how repetitive each is, by context length. No text is kept.

``probe`` talks to the two servers, ``verdict`` judges the results by context length,
``capture`` writes the candidate's requests as a capture for `kvdoctor diagnose`."""
from __future__ import annotations

from .capture import write_capture
from .probe import Comparison, agreement, complete, compare, read_prompts
from .verdict import by_context, verdict

__all__ = ["Comparison", "agreement", "by_context", "complete", "compare", "read_prompts", "verdict", "write_capture"]
