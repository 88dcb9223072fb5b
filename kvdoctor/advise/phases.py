"""The measured phase split: how much of the server's busy time went to prefill and to decode.

Busy time is the union over requests of [prefill start, finish]: while it lasts the engine has
work. Prefill GPU time is counted twice over, to give a range rather than a point:

* the cost model: each request's uncached prompt tokens x the prefill cost per token measured
  at the capture's low load (`prefill_ms_per_1k_tokens_low_load`): prefill is compute-bound, so
  its work adds up whether prefills ran alone or beside decodes (the estimate); the same with
  the cost per token that decode stalls show, where the capture has per-request ITL (the lower
  end, when lower);
* the occupancy: the union of prefill windows [prefill start, first token]: time with at least
  one prefill in progress (upper end: it includes decode steps sharing those windows).

Decode GPU time is the rest of the busy time. Shares are fractions of busy time, so
prefill_share + decode_share = 1. The prefill:decode instance ratio that balances the two
phases for this workload (DistServe's allocation, its Section 4) is prefill : decode GPU time,
both at the capture's own batch sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..signals import Prepared, Window
from ..signals.interference import prefill_windows


def union_s(start: np.ndarray, end: np.ndarray) -> float:
    """Total length of the union of intervals [start, end] (finite, end > start)."""
    m = np.isfinite(start) & np.isfinite(end) & (end > start)
    if not m.any():
        return 0.0
    order = np.argsort(start[m], kind="stable")
    s, e = start[m][order], end[m][order]
    reach = np.maximum.accumulate(e)
    # a new block starts where an interval begins after everything before it has ended
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    block_end = reach[np.append(idx[1:] - 1, len(s) - 1)]
    return float((block_end - s[idx]).sum())


@dataclass(frozen=True)
class PhaseSplit:
    requests: int
    busy_s: float
    prefill_gpu_s: tuple[float, float, float]   # (low, estimate, high)
    prefill_cost_s_per_token: float
    decode_streams_mean: float                  # decode concurrency while decoding (batch)

    @property
    def decode_gpu_s(self) -> tuple[float, float, float]:
        lo, mid, hi = self.prefill_gpu_s
        return self.busy_s - hi, self.busy_s - mid, self.busy_s - lo

    def share(self, which: str) -> tuple[float, float, float]:
        """(low, estimate, high) share of busy time of "prefill" or "decode"."""
        v = self.prefill_gpu_s if which == "prefill" else self.decode_gpu_s
        return tuple(x / self.busy_s if self.busy_s > 0 else float("nan") for x in v)

    def ratio(self) -> tuple[float, float, float]:
        """(low, estimate, high) prefill : decode GPU-time ratio (instances per decode instance)."""
        (plo, pmid, phi), (dlo, dmid, dhi) = self.prefill_gpu_s, self.decode_gpu_s
        f = (lambda a, b: a / b if b > 0 else float("inf"))
        return f(plo, dhi), f(pmid, dmid), f(phi, dlo)


def measure(prep: Prepared, window: Window) -> PhaseSplit | None:
    """The phase split of a capture; None when it has no request times to build it from."""
    start, first, tokens = prefill_windows(prep)
    fin = prep.col["finish_s"]
    ok = np.isfinite(start) & np.isfinite(first) & np.isfinite(fin) & (fin >= first)
    if ok.sum() < 2:
        return None
    busy = union_s(start[ok], fin[ok])
    cost = window.value("prefill_ms_per_1k_tokens_low_load") / 1e6
    occupancy = min(union_s(start[ok], first[ok]), busy)
    # prefill cannot take longer than the time some prefill was in progress: the occupancy
    # caps a cost model read off a slow low-load sample
    model = min(float((tokens[ok] * cost).sum()), occupancy) if np.isfinite(cost) else occupancy
    # the prefill cost per token the decode gaps show (signals/interference.py) is a second,
    # independent reading of the same cost: the lower of the two bounds the range below
    stall_cost = window.value("itl_prefill_stall_ms_per_1k_tokens") / 1e6
    lo = min(model, float((tokens[ok] * stall_cost).sum())) if np.isfinite(stall_cost) and stall_cost > 0 else model
    hi = occupancy
    decoding = prep.col["decode_concurrency"][ok]
    return PhaseSplit(requests=int(ok.sum()), busy_s=busy, prefill_gpu_s=(lo, model, hi),
                      prefill_cost_s_per_token=cost,
                      decode_streams_mean=float(np.nanmean(decoding)) if np.isfinite(decoding).any() else float("nan"))


#: an allocation is good enough when its goodput per instance is within this share of the
#: ideal (a ratio matched exactly): more instances buy the last few percent
ALLOCATION_EFFICIENCY = 0.9


def allocation_efficiency(ratio: float, split: tuple[int, int]) -> float:
    """Goodput per instance of (prefill, decode) instances over the ideal, for a workload whose
    prefill:decode GPU time per request is ``ratio`` (the slower pool sets the rate)."""
    p, d = split
    return min(p / ratio, d) / (p + d) * (ratio + 1)


def instance_split(ratio: float, max_instances: int = 16) -> tuple[int, int]:
    """The smallest (prefill, decode) instance counts whose goodput per instance is within 10%
    of the ideal for this prefill:decode GPU-time ratio (the best one when none is)."""
    if not np.isfinite(ratio) or ratio <= 0:
        return (1, 1)
    best, best_eff = (1, 1), allocation_efficiency(ratio, (1, 1))
    for total in range(2, max_instances + 1):
        for p in range(1, total):
            eff = allocation_efficiency(ratio, (p, total - p))
            if eff > best_eff + 1e-12:
                best, best_eff = (p, total - p), eff
        if best_eff >= ALLOCATION_EFFICIENCY:
            return best
    return best


def goodput_per_instance(prefill_rps: float, decode_rps: float, split: tuple[int, int]) -> float:
    """Requests/s per instance of a disaggregated deployment whose prefill instances each
    sustain prefill_rps and decode instances decode_rps (the slower pool sets the rate)."""
    p, d = split
    return min(p * prefill_rps, d * decode_rps) / (p + d)
