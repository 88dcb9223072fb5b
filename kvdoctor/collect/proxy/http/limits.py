"""The bounds of the proxy's HTTP/1.1 core and the framing it accepts, the same on both legs."""

#: bytes of request or status line and headers one message may have (aiohttp's client allowed ~8 KiB a line)
MAX_HEAD_BYTES = 64 * 1024
#: header lines one message may have
MAX_HEADERS = 256
#: body bytes buffered for a reader that has not taken them yet before reading pauses (from the
#: client while the relay has not taken a request body, from the upstream while a slow client has
#: not taken a response)
HIGH_WATER_BYTES = 1 << 20


def chunked_only(value: bytes) -> bool:
    """A ``Transfer-Encoding`` value that is chunked and nothing else. llhttp undoes only the
    chunked framing: a body under another coding (``gzip, chunked``) would be relayed still coded,
    with the header that says so dropped as hop-by-hop, so neither leg accepts one."""
    return [c.strip() for c in value.lower().split(b",")] == [b"chunked"]
