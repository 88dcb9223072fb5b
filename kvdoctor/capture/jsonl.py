"""JSON Lines as the importers read them: the non-blank lines numbered from 1, and each line's
JSON or an error naming the file, the line and what was expected there."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import orjson

from ..errors import InputError


def numbered(lines: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines, each with its line number (1-based, blank lines counted)."""
    return ((n, line) for n, line in enumerate(lines, 1) if line.strip())


def file_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """:func:`numbered` lines of a file, read as they are used; InputError when it cannot be read."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    with f:
        yield from numbered(f)


def loads_line(path: Path, n: int, line: bytes, expected: str) -> Any:
    """Line ``n``'s JSON; InputError "PATH: line N: not valid JSON (…); expected EXPECTED"."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise InputError(f"{path}: line {n}: not valid JSON ({e.msg}); expected {expected}") from None


def json_lines(path: Path, expected: str) -> Iterator[tuple[int, Any]]:
    """(line number, JSON value) of each non-blank line of a file."""
    for n, line in file_lines(path):
        yield n, loads_line(path, n, line, expected)
