"""What every importer returns, and the one place that writes it as a capture."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..capture.writer import CaptureWriter
from ..model import CaptureMeta


@dataclass
class Imported:
    """Records parsed from outside files, plus the meta they imply.

    ``records`` may be a generator: the writer streams it, so a large file is never held whole.
    """

    meta: CaptureMeta
    records: Iterable[Any]
    notes: list[str] = field(default_factory=list)


#: Signature every importer module exposes as ``read``: files and ``--opt KEY=VALUE`` options.
Reader = Callable[[list[Path], dict[str, Any]], Imported]


def write_capture(imported: Imported, out: Path, *, progress: Callable[[int], None] | None = None) -> int:
    """Write an import as a capture folder; returns how many records were written."""
    meta = dataclasses.replace(imported.meta, created_unix_s=imported.meta.created_unix_s or time.time())
    n = 0
    with CaptureWriter(out, meta) as w:
        for rec in imported.records:
            w.write(rec)
            n += 1
            if progress is not None and n % 10000 == 0:
                progress(n)
    return n
