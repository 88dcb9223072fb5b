"""Small pieces the commands share."""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def progress_callback(desc: str, unit: str = "it") -> Iterator[Callable[[int, int], None] | None]:
    """A ``callback(done, total)`` drawing a progress bar on a terminal; None when piped,
    so scripts and CI logs stay clean."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()
