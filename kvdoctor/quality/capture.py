"""The candidate's side of a probe as a capture, for `kvdoctor diagnose`."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .probe import Comparison


def write_capture(results: list[Comparison], out: Path, candidate: str, config: dict[str, Any]) -> None:
    """The candidate's requests as a capture, each carrying its baseline comparison, so that
    `kvdoctor diagnose` can judge kv-quant-quality against the baseline."""
    from ..capture import CaptureWriter
    from ..collect.identify import identify
    from ..model import CaptureMeta, RequestRecord

    # the candidate's engine, version and model, asked of it, so the fixes name its own knobs
    who = identify(candidate)
    meta = CaptureMeta(created_unix_s=time.time(), server=candidate, origin="quality", engine=who.engine,
                       engine_version=who.version, model=who.model, config={**(who.config or {}), **config})
    with CaptureWriter(out, meta) as w:
        for r in results:
            w.write(RequestRecord(request_id=f"q{r.index}", arrival_s=r.started_s, e2e_s=r.candidate_s,
                                  prompt_tokens=r.prompt_tokens, output_tokens=r.candidate_output_tokens,
                                  output_repetition=r.candidate_repetition, baseline_agreement_frac=r.agreement_frac,
                                  baseline_output_repetition=r.baseline_repetition,
                                  baseline_forced_agreement_frac=r.forced_agreement_frac, server=candidate, status="ok"))
