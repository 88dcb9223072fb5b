"""Small pieces the commands share."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Callable, Iterator

from ..units import printable  # noqa: F401  (commands import it from here)


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


#: C0 controls but tab and newline, DEL and C1 controls: bytes from a capture, a trace file or an
#: upstream that a terminal would act on (colour, cursor moves, title changes, ...)
def write_out(text: str, output: str | None) -> None:
    """A command's result: to the --output file when given, else to standard output; control
    characters from the data never reach a terminal (nor a file someone will cat)."""
    text = printable(text)
    if output:
        Path(output).write_text(text)
    else:
        sys.stdout.write(text)
