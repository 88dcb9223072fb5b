"""Small array facts the signal modules share."""
from __future__ import annotations

import numpy as np


def is_sorted(a: np.ndarray) -> bool:
    """Whether ``a`` is in non-decreasing order (NaN-free arrays; a window is then a searchsorted range)."""
    return len(a) < 2 or bool(np.all(a[1:] >= a[:-1]))
