"""A Capture built from records held in memory: what live diagnosis evaluates each step."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa

from ..model import CaptureMeta, to_dict
from .columns import SCHEMAS, Capture, Columns
from .derived import _derive, _engine_series


def _dicts(records: Iterable[Any]) -> list[dict[str, Any]]:
    return [r if isinstance(r, dict) else to_dict(r) for r in records]


def from_records(meta: CaptureMeta, requests: Iterable[Any] = (), gpu: Iterable[Any] = (), host: Iterable[Any] = (),
                 engine: Iterable[Any] = (), events: Iterable[Any] = (), path: str = "<live>") -> Capture:
    """Same columns and derivations as a capture read from disk."""
    def table(kind: str, rows: Iterable[Any]) -> pa.Table:
        return pa.Table.from_pylist(_dicts(rows), schema=SCHEMAS[kind])

    return Capture(
        path=Path(path), meta=meta,
        requests=Columns(_derive(table("requests", requests))),
        gpu=Columns(table("gpu", gpu)), host=Columns(table("host", host)),
        engine=_engine_series(_dicts(engine)), events=_dicts(events),
    )
