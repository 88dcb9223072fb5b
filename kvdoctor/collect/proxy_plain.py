"""The relay's fast path for the common request: one read that holds a whole, plain
``POST ... HTTP/1.1`` request (head and body, nothing before or after it) is rewritten for the
upstream hop with a few C-level bytes operations and sent on before Python parses it at all;
the parser (llhttp) then reads the same bytes for the bookkeeping, after they left.

Why: on a busy host the relay wakes with cold caches, and the bytes it runs before the request
leaves are most of what it adds to TTFT over nginx. Parsing through llhttp's per-header callbacks,
the request object, the hop-by-hop filter and the head's rebuild took ~70 us cold; this check and
rewrite are a regular expression and a handful of ``find`` calls.

Only what needs no judgement goes this way: the request line and every header line must match the
strict grammar below (an RFC 9110 token, a printable value), so llhttp accepts it and reads the same
head; ``Content-Length`` once, equal to the body's length in this read; no ``Transfer-Encoding``,
``TE``, ``Trailer``, ``Upgrade``, ``Expect``, ``Keep-Alive``, ``Proxy-*``, and ``Connection`` only as
``keep-alive``. The rewrite is the same as the slow path's: ``Host`` becomes the upstream's,
``Connection: keep-alive`` is dropped, the upstream URL's path goes before the target; every other
header goes on byte for byte, in order. Anything else (pipelined, split across reads, chunked,
an absolute-form target, a GET) returns None and takes the slow path.
"""
from __future__ import annotations

import re

#: the longest head tried (a chat request's is ~200-400 bytes); longer ones take the slow path
MAX_PLAIN_HEAD_BYTES = 8192

#: the request line and header lines, strictly (RFC 9110 token names, printable ASCII values); a
#: name that needs the slow path (Transfer-Encoding, TE, Trailer, Upgrade, Expect, Keep-Alive,
#: Proxy-*) fails the match. One C call: each Python step here costs microseconds with cold caches.
_PLAIN_HEAD = re.compile(
    rb"POST /[A-Za-z0-9\-._~:/?\[\]@!$&'()*+,;=%]* HTTP/1\.1\r\n"
    rb"(?:(?!(?i:transfer-encoding:|te:|trailers?:|upgrade:|expect:|keep-alive:|proxy-))"
    rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\x20-\x7e\t]*\r\n)*\r\n")


def plain_request(data: bytes, host_header: bytes, prefix: bytes = b"",
                  max_body_bytes: int = 1 << 24) -> tuple[bytes, bytes] | None:
    """``(head, body)`` to write upstream for ``data``, one read holding exactly one plain request;
    None when it is not one (the slow path handles it)."""
    end = data.find(b"\r\n\r\n", 0, MAX_PLAIN_HEAD_BYTES)
    if end < 0 or _PLAIN_HEAD.fullmatch(data, 0, end + 4) is None:
        return None
    lh = data[:end + 2].lower()  # header lines each start after a CRLF: names are found as b"\r\nname:"
    i = lh.find(b"\r\ncontent-length:")
    if i < 0:
        return None
    j = lh.find(b"\r\n", i + 17)
    length = lh[i + 17:j].strip()
    body_bytes = len(data) - end - 4
    if not length.isdigit() or int(length) != body_bytes or body_bytes > max_body_bytes \
            or lh.find(b"\r\ncontent-length:", j) >= 0:
        return None
    cuts = []  # the lines the slow path drops too: Host (written anew) and Connection: keep-alive
    h = lh.find(b"\r\nhost:")
    if h >= 0:
        k = lh.find(b"\r\n", h + 7)
        if lh.find(b"\r\nhost:", k) >= 0:
            return None
        cuts.append((h, k))
    c = lh.find(b"\r\nconnection:")
    if c >= 0:
        k = lh.find(b"\r\n", c + 13)
        if lh[c + 13:k].strip() != b"keep-alive" or lh.find(b"\r\nconnection:", k) >= 0:
            return None
        cuts.append((c, k))
    first = data.find(b"\r\n")
    parts = [b"POST ", prefix, data[5:first], b"\r\nHost: ", host_header]
    at = first
    if len(cuts) == 2 and cuts[1] < cuts[0]:
        cuts.reverse()
    for a, b in cuts:
        parts.append(data[at:a])
        at = b
    parts.append(data[at:end + 4])
    return b"".join(parts), data[end + 4:]
