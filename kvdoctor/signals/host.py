"""The host around the server (psutil samples): how much of the machine other processes took."""
from __future__ import annotations

import numpy as np

from .registry import signal


def _other_cpu_frac(col) -> np.ndarray:
    """Per host sample (``col``: a column getter): the host's busy share minus the server tree's
    cores over the CPU count."""
    count = col("host_cpu_count")
    return col("host_cpu_frac") - col("server_cpu_cores") / np.where(count > 0, count, np.nan)


@signal("host_other_cpu_frac", "fraction")
def host_other_cpu_frac(w):
    """Median share of the host's CPUs busy with processes other than the server's tree
    (host busy share minus the server's cores over the host's CPU count). High: the engine's
    threads wait for a core, and its decode steps stall for reasons outside the engine."""
    other = _other_cpu_frac(w.host_col)
    other = other[np.isfinite(other)]
    return float(np.clip(np.median(other), 0.0, 1.0)) if len(other) else np.nan


@signal("server_run_wait_frac", "fraction")
def server_run_wait_frac(w):
    """Share of the server's runnable time spent waiting for a CPU over the window: its threads'
    run-queue delay over that delay plus the CPU they got (the kernel's schedstat, summed over the
    host samples, so busy seconds weigh by their work and a nearly idle second's few microseconds
    of wait do not swing it). Near 0: every thread that could run, ran. High: the engine's threads
    wait for a core (other processes, or more engine threads than cores), and each step that needs
    all of them waits for the slowest. Unknown where the capture has no such samples (recorded
    before 2026-12-06, or not on Linux) or the server never ran."""
    wait, cores = w.host_col("server_run_wait_cores"), w.host_col("server_cpu_cores")
    ok = np.isfinite(wait) & np.isfinite(cores)
    waited = float(np.sum(wait[ok]))
    runnable = waited + float(np.sum(cores[ok]))
    return waited / runnable if runnable > 0 else np.nan


#: other processes' share of the host above which a request's latency is the host's, not the engine's
CONTENDED_OTHER_FRAC = 0.25


def contended(w) -> np.ndarray:
    """Per request of the window: True when other processes held at least CONTENDED_OTHER_FRAC of
    the host while it ran (host samples nearest its arrival, midpoint and finish). False where the
    capture has no such samples. Trends through a run (growth per turn) leave these requests out:
    contention only adds time, so it bends a trend the KV cache did not make."""
    key = "host_contended"
    if key in w._cache:
        return w._cache[key]
    out = np.zeros(w.n_requests, dtype=bool)
    prep = w.prep
    if len(prep.host_t):
        other = _other_cpu_frac(prep.cap.host.num)
        ok = np.isfinite(prep.host_t) & np.isfinite(other)
        ht, other = prep.host_t[ok], other[ok]
        if len(ht):
            order = np.argsort(ht)
            ht, other = ht[order], other[order]
            start, end = w.r("arrival_s"), w.r("finish_s")
            end = np.where(np.isfinite(end), end, start)
            for x in (start, (start + end) / 2, end):
                i = np.clip(np.searchsorted(ht, np.nan_to_num(x, nan=-np.inf)), 0, len(ht) - 1)
                out |= np.isfinite(x) & (other[i] >= CONTENDED_OTHER_FRAC)
    w._cache[key] = out
    return out
