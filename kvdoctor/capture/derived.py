"""Columns derived at load time, the same for a capture read from disk and one built in
memory (kvdoctor.capture.memory): request latencies filled from each other, engine samples as
per-name arrays."""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .columns import EngineSeries


def _engine_series(rows: list[dict[str, Any]]) -> EngineSeries:
    rows.sort(key=lambda r: r.get("time_s", 0.0))
    n = len(rows)
    t = np.array([float(r.get("time_s", np.nan)) for r in rows], dtype=float)
    values: dict[str, np.ndarray] = {}
    hists: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for i, r in enumerate(rows):
        for k, v in (r.get("values") or {}).items():
            arr = values.get(k)
            if arr is None:
                arr = values[k] = np.full(n, np.nan)
            if isinstance(v, (int, float)):
                arr[i] = v
        for k, h in (r.get("histograms") or {}).items():
            hists.setdefault(k, []).append((t[i], h))
    engines = {r.get("engine") for r in rows if r.get("engine")}
    return EngineSeries(time_s=t, values=values, histograms=hists,
                        servers=[r.get("server") for r in rows],
                        engine=next(iter(engines)) if len(engines) == 1 else None)


def _derive(table: pa.Table) -> pa.Table:
    """Vectorised counterpart of model.derive_request: fill what follows from other fields."""
    def num(name):
        return table.column(name)

    def fill(name, expr):
        """``name`` where known, else ``expr()`` (made only where some row needs it)."""
        nonlocal table
        col = table.column(name)
        if col.null_count == 0:
            return
        new = pc.coalesce(col, expr())
        table = table.set_column(table.schema.get_field_index(name), name, new)

    def tpot():
        out_tok = num("output_tokens")
        decode = pc.max_element_wise(pc.subtract(num("e2e_s"), num("ttft_s")), pa.scalar(0.0), skip_nulls=False)
        return pc.if_else(pc.greater(out_tok, 1), pc.divide(decode, pc.subtract(out_tok, 1)), pa.scalar(None, pa.float64()))

    arrival = num("arrival_s")
    fill("ttft_s", lambda: pc.subtract(num("first_token_s"), arrival))
    fill("e2e_s", lambda: pc.subtract(num("finish_s"), arrival))
    fill("finish_s", lambda: pc.add(arrival, num("e2e_s")))
    fill("first_token_s", lambda: pc.add(arrival, num("ttft_s")))
    fill("tpot_s", tpot)
    fill("status", lambda: pc.if_else(pc.is_null(num("error")), pa.scalar("ok"), pa.scalar("error")))
    return table

