"""The proxy's HTTP/1.1 core, on asyncio's protocol API and llhttp's C parser (``httptools``: the
one place in kvdoctor that imports it): the server clients talk to (server.py, one request and
its reply: exchange.py) and the client to the upstream (client.py, its responses: response.py)."""
from .client import UpstreamClient, UpstreamConnection
from .exchange import Reply, Request
from .limits import HIGH_WATER_BYTES, MAX_HEAD_BYTES, MAX_HEADERS
from .response import BrokeMidBody, ClosedEarly, Malformed, Response, Unreachable, UpstreamError
from .server import ClientConnection, ProxyServer

__all__ = ["HIGH_WATER_BYTES", "MAX_HEADERS", "MAX_HEAD_BYTES", "BrokeMidBody", "ClientConnection", "ClosedEarly",
           "Malformed", "ProxyServer", "Reply", "Request", "Response", "Unreachable", "UpstreamClient",
           "UpstreamConnection", "UpstreamError"]
