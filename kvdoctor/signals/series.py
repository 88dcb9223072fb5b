"""Engine and GPU series helpers: GPU rows from exporter metrics for captures without NVML
samples (used once per capture by Prepared), and per-interval decode steps from engine counters
for captures without request records (used by Window.engine_tpot_steps).
"""
from __future__ import annotations

import numpy as np

from ..capture import Capture

#: GPU sample fields an exporter scraped beside the engine (DCGM, through a scrape or Prometheus)
#: stands in for when the capture has no NVML samples: GpuSample field -> neutral engine name.
#: DCGM gives one series per GPU; the engine mapping has already summed memory and averaged
#: utilisation over an instance's GPUs, so these rows are per instance, not per GPU.
GPU_FROM_ENGINE = {"mem_used_bytes": "gpu_mem_used_bytes", "mem_total_bytes": "gpu_mem_total_bytes",
                   "sm_util_frac": "gpu_util_frac", "mem_util_frac": "gpu_mem_copy_util_frac",
                   "dram_bw_util_frac": "gpu_dram_active_frac", "power_w": "gpu_power_w"}


def gpu_from_engine(cap: Capture):
    """GPU rows (one per engine sample) from exporter metrics in the engine samples, for
    captures without NVML: the same GPU signals and charts then work on DCGM data."""
    import pyarrow as pa

    from ..capture import Columns

    eng = cap.engine
    cols = {f: eng.get(n) for f, n in GPU_FROM_ENGINE.items()}
    free = eng.get("gpu_mem_free_bytes")
    if cols["mem_total_bytes"] is None and cols["mem_used_bytes"] is not None and free is not None:
        cols["mem_total_bytes"] = cols["mem_used_bytes"] + free
    cols = {k: v for k, v in cols.items() if v is not None and np.isfinite(v).any()}
    if not cols:
        return cap.gpu
    keep = np.logical_or.reduce([np.isfinite(v) for v in cols.values()])
    table = {"time_s": eng.time_s[keep], "gpu_index": np.zeros(int(keep.sum()))}
    table.update({k: v[keep] for k, v in cols.items()})
    return Columns(pa.table(table))


def tpot_steps(t: np.ndarray, running: np.ndarray, decode_s: np.ndarray, generated: np.ndarray,
               tpot_hist_rows) -> tuple[np.ndarray, np.ndarray]:
    """(requests running, TPOT) per interval between consecutive engine samples at times ``t``:
    TPOT from the decode-seconds / generated-tokens counters (llama.cpp), else the interval's
    median of the TPOT histogram (``tpot_hist_rows``: (time, snapshot) pairs)."""
    from ..engines.rates import histogram_delta, histogram_quantile

    empty = (np.array([]), np.array([]))
    if len(running) < 3:
        return empty
    if np.isfinite(decode_s).sum() >= 3 and np.isfinite(generated).sum() >= 3:
        d_s, d_t = np.diff(decode_s), np.diff(generated)
        with np.errstate(all="ignore"):
            tpot = np.where((d_t >= 1) & (d_s >= 0), d_s / d_t, np.nan)
    else:
        if not tpot_hist_rows:
            return empty
        snap = dict(tpot_hist_rows)  # time -> histogram snapshot
        tpot = np.full(len(t) - 1, np.nan)
        for i in range(len(t) - 1):
            a, b = snap.get(t[i]), snap.get(t[i + 1])
            d = histogram_delta(a, b) if a is not None and b is not None else None
            if d and d.get("count"):
                tpot[i] = d["sum"] / d["count"] if d.get("sum") else histogram_quantile(0.5, None, d)
    # running at the end of each interval: the batch that decoded through it
    return running[1:], tpot
