"""The host around the server (psutil samples): how much of the machine other processes took."""
from __future__ import annotations

import numpy as np

from .registry import signal


@signal("host_other_cpu_frac", "fraction")
def host_other_cpu_frac(w):
    """Median share of the host's CPUs busy with processes other than the server's tree
    (host busy share minus the server's cores over the host's CPU count). High: the engine's
    threads wait for a core, and its decode steps stall for reasons outside the engine."""
    busy, server, count = w.host_col("host_cpu_frac"), w.host_col("server_cpu_cores"), w.host_col("host_cpu_count")
    other = busy - server / np.where(count > 0, count, np.nan)
    other = other[np.isfinite(other)]
    return float(np.clip(np.median(other), 0.0, 1.0)) if len(other) else np.nan
