"""Numbers for the page around the charts: error messages (the key numbers are the
diagnosis's own, kvdoctor/diagnosis/numbers.py)."""
from __future__ import annotations

from collections import Counter

import numpy as np

from ...diagnosis import Diagnosis


def error_messages(diag: Diagnosis) -> Counter:
    """Error message → count (for callers that want them without the chart)."""
    req = diag.capture.requests
    codes, labels = req.codes("error")
    return Counter({labels[i]: int(c) for i, c in enumerate(np.bincount(codes[codes >= 0], minlength=len(labels))) if c})
