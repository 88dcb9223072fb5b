"""Property tests (issue 14, proof): whatever bytes reach the capture reader, an importer, the
Prometheus text parser, the rule loader or the OTLP decoder, the answer is a result or the
project's own located error, never another exception. Bounded: a few dozen examples each, no
per-example deadline (a shared CI machine), about a minute in all."""
from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvdoctor  # noqa: E402
from kvdoctor.errors import InputError, KvdoctorError, RuleError  # noqa: E402

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

#: JSON-ish values of the shapes the formats use, plus the odd ones (huge ints, NaN-like strings)
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10 ** 30), max_value=10 ** 30),
                    st.floats(allow_nan=False), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
REQUEST_KEYS = ["request_id", "arrival_s", "ttft_s", "e2e_s", "output_tokens", "prompt_tokens", "itl_s",
                "prefix_block_hashes", "status", "turn", "session_id", "error", "http_status"]
records = st.dictionaries(st.sampled_from(REQUEST_KEYS), values, max_size=6)
junk_lines = st.one_of(st.binary(max_size=60), records.map(lambda d: json.dumps(d).encode()),
                       records.map(lambda d: json.dumps(d).encode()[: len(json.dumps(d)) // 2]))


@FUZZ
@given(st.lists(junk_lines, min_size=1, max_size=8), st.booleans())
def test_capture_reader_reads_or_names_the_line(lines, torn_end):
    with tempfile.TemporaryDirectory() as d:
        cap = Path(d)
        (cap / "requests-000001.jsonl").write_bytes(b"\n".join(lines) + (b"" if torn_end else b"\n"))
        (cap / "events-000001.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        try:
            c = kvdoctor.load(cap)
        except InputError as e:
            assert "-000001.jsonl" in str(e) or "meta.json" in str(e)
            return
        assert len(c.requests) <= len(lines)


@FUZZ
@given(st.dictionaries(st.sampled_from(["format_version", "created_unix_s", "clock", "sources", "config",
                                        "text_stored", "engine", "extra"]), values, max_size=5))
def test_meta_json_loads_or_names_the_field(meta):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "meta.json").write_bytes(json.dumps({"format_version": 1, **meta}).encode())
        try:
            kvdoctor.load(d)
        except InputError as e:
            assert "meta.json" in str(e)


IMPORT_TEXT = st.one_of(
    st.text(max_size=300),
    st.lists(records.map(json.dumps), max_size=5).map("\n".join),
    st.lists(st.lists(st.text(alphabet=string.ascii_letters + string.digits + ".-", max_size=6), min_size=2,
                      max_size=4).map(",".join), min_size=1, max_size=5).map(lambda rows: "a,b,c\n" + "\n".join(rows)),
)


@pytest.mark.parametrize("fmt,suffix", [("vllm-bench", ".json"), ("llmperf", ".jsonl"), ("csv", ".csv"),
                                        ("mooncake", ".jsonl"), ("otlp-json", ".json"), ("prometheus", ".txt")])
def test_every_importer_imports_or_names_the_problem(fmt, suffix):
    from click.testing import CliRunner

    from kvdoctor.cli import cli

    @FUZZ
    @given(IMPORT_TEXT)
    def check(text):
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / f"in{suffix}"
            src.write_text(text)
            args = ["import", fmt, str(src), "-o", str(Path(d) / "cap")]
            if fmt == "csv":
                args += ["--col", "arrival_s=a", "--col", "ttft_s=b"]
            res = CliRunner().invoke(cli, args)
            assert res.exit_code in (0, 1, 2), (text, res.output, res.exception)
            assert "Traceback" not in res.output

    check()


PROM_LINES = st.one_of(
    st.text(max_size=80),
    st.builds(lambda n, l, v: f"{n}{{{l}}} {v}", st.sampled_from(["vllm:num_requests_running", "llamacpp:kv_cache_usage_ratio",
                                                                   "vllm:cache_config_info", "vllm:e2e_request_latency_seconds_bucket",
                                                                   "sglang:token_usage"]),
              st.sampled_from(['le="+Inf"', 'le="0.5"', 'num_gpu_blocks="123456789012345678901234"', 'model_name="m"',
                               'a="\\"', '']),
              st.one_of(st.floats().map(repr), st.sampled_from(["NaN", "+Inf", "-1e300", "x", "1e400"]))),
    st.sampled_from(["# TYPE vllm:num_requests_running gauge", "# TYPE vllm:e2e_request_latency_seconds histogram",
                     "# HELP x y", "# TYPE x bogus"]),
)


@FUZZ
@given(st.lists(PROM_LINES, max_size=12))
@example(['vllm:e2e_request_latency_seconds_bucket{model_name="m"} 0.0'])  # a bucket without le (found by this test)
def test_prometheus_text_parses_or_names_the_line(lines):
    from kvdoctor.engines import parse_scrape

    try:
        parse_scrape("\n".join(lines) + "\n", 0.0, "s")
    except InputError:
        pass


RULE_TEXT = st.one_of(
    st.text(max_size=200),
    st.builds(lambda when, rid: f"id: {rid}\ntitle: t\nseverity: warning\nsymptom:\n  name: s\n  when: {when}\n"
                                "causes: []\nevidence: []\nfixes: []\ntests: {{fire: [], no_fire: []}}\n",
              st.one_of(st.text(max_size=40), st.sampled_from(["ttft_p99_s > 1", "{all: [ttft_p99_s > 1]}", "[",
                                                                "&a [*a]", "{any: []}", "ttft_p99_s >"])),
              st.just("r")),
)


@FUZZ
@given(RULE_TEXT)
def test_rule_loader_loads_or_names_the_problem(text):
    from kvdoctor.diagnosis.rules import load_rule

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.yaml"
        path.write_text(text)
        try:
            load_rule(path)
        except RuleError as e:
            assert "r.yaml" in str(e)


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.builds(lambda v: json.dumps({"resourceSpans": v}).encode(), values)),
       st.sampled_from(["application/x-protobuf", "application/json"]), st.sampled_from(["identity", "gzip"]))
@example(b'{"resourceSpans": true}', "application/json", "identity")  # found by this test
@example(b'{"resourceSpans": [{"scopeSpans": 1}]}', "application/json", "identity")
def test_otlp_decoder_decodes_or_says_bad_request(body, content_type, encoding):
    from kvdoctor.collect import otlp_receiver as R

    try:
        msg = R._inflate_decode(body, encoding, content_type)
    except (R._BadRequest, R._TooLarge):
        return
    stats = {"spans": 0}
    R.records_from_request(msg, stats)


def test_the_errors_are_the_projects_own():
    assert issubclass(InputError, KvdoctorError) and issubclass(RuleError, KvdoctorError)


# -- the proxy's HTTP/1.1 core against h11 (a well-kept pure-Python HTTP/1.1 state machine) --------
# Differential: the same bytes to the proxy's own server (llhttp, kvdoctor/collect/proxy/http) and to
# h11, then the messages each framed compared. Where both take a message, it must be the same one
# (method, target, headers, body); where the proxy takes one h11 refuses, h11's reason must be one
# that cannot change where a message ends (BENIGN); the proxy may refuse more than h11 does.
h11 = pytest.importorskip("h11")

DIFF = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

#: h11 refusals that say nothing of where a message ends: the proxy writes its own Host upstream
BENIGN_REQUEST = ("Missing mandatory Host: header", "Found multiple Host: headers")



def _mostly(usual: list, odd: list, odd_share: float = 0.06):
    """A draw from ``usual``, or ``odd`` about ``odd_share`` of the time: each request has a dozen parts,
    so most requests stay well-formed (their messages get compared) and the odd part is one of them."""
    return st.sampled_from(usual * max(1, round(len(odd) * (1 - odd_share) / odd_share / len(usual))) + odd)


EOLS = _mostly([b"\r\n"], [b"\n"], 0.05)
_METHODS = _mostly([b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS"], [b"get", b"FOO", b"G(T", b""])
_TARGETS = _mostly([b"/", b"/v1/chat/completions", b"/a?b=c&d=%2F", b"http://h:8/p?q"],
                   [b"*", b"/a b", b"", b"/\x7f", b"/caf\xc3\xa9"])
_VERSIONS = _mostly([b"HTTP/1.1"] * 4 + [b"HTTP/1.0"], [b"HTTP/2.0", b"HTTP/1.2", b"http/1.1", b"HTTP/1.1 "])
_NAMES = _mostly([b"X-A", b"Accept", b"Content-Type", b"Authorization", b"Connection", b"Expect"],
                 [b"Host", b"Content-Length", b"Transfer-Encoding", b"Upgrade", b"Trailer", b"content-length",
                  b"Content-Length ", b"X A", b" X-A", b"X\tA", b"", b"X\x00"], 0.1)
_VALUES = _mostly([b"x", b"", b" a ", b"a, b", b"Bearer k", b"0", b"3", b"chunked", b"close", b"keep-alive",
                   b"100-continue", b"a\tb"],
                  [b"+3", b"-1", b"3, 3", b"00003", b" chunked", b"CHUNKED", b"gzip, chunked", b"chunked, gzip",
                   b"identity", b"upgrade", b"a\x00b", b"caf\xc3\xa9", b"a\rb", b"\x7f"], 0.15)


def _frame(draw, headers: list, body: bytes, unframed: str, codings, trailers: bool = False) -> bytes:
    """``body`` as drawn framed: Content-Length (right, or a few bytes off), chunked (the odd size
    spelling now and then; a trailer on a request), both, or neither (``unframed``: a request's body
    is then the next request's start, a response's ends with the connection). The framing headers
    are appended to ``headers``."""
    framing = draw(_mostly(["length", "chunked", unframed], ["bad-length", "both"], 0.1))
    if framing in ("length", "both"):
        headers.append((b"Content-Length", b"%d" % len(body)))
    elif framing == "bad-length":
        headers.append((b"Content-Length", b"%d" % (len(body) + draw(st.sampled_from([-1, 1, 100])))))
    if framing not in ("chunked", "both"):
        return body
    headers.append((b"Transfer-Encoding", draw(codings)))
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]) if b > a]
    size = draw(_mostly([b"%x", b"%X", b"%04x", b"%x;ext=1"], [b"%x ", b"%x;e=\"q\"", b"-%x", b"%x;"]))
    body = b"".join(size % len(c) + b"\r\n" + c + b"\r\n" for c in chunks) + b"0\r\n"
    if not trailers:
        return body + b"\r\n"
    trailer = draw(_mostly([b"", b"X-T: 1\r\n", b"X-Forwarded-For: 10.0.0.1\r\n"],
                           [b"Content-Length: 5\r\n", b"Bad Trailer\r\n"], 0.2))
    return body + trailer + draw(_mostly([b"\r\n"], [b""]))


@st.composite
def http_requests(draw) -> bytes:
    """One request, mostly well-formed (so messages get compared), with the odd part drawn in."""
    eol = draw(EOLS)
    head = draw(_METHODS) + b" " + draw(_TARGETS) + b" " + draw(_VERSIONS) + eol
    headers = [(b"Host", b"x")] if draw(st.integers(0, 9)) else []
    headers += draw(st.lists(st.tuples(_NAMES, _VALUES), max_size=4))
    body = _frame(draw, headers, draw(st.binary(max_size=24)), "none", st.just(b"chunked"), trailers=True)
    sep = draw(_mostly([b": ", b":"], [b":  ", b" : "]))
    return head + b"".join(k + sep + v + eol for k, v in headers) + eol + body


def _proxy_server_frames(stream: bytes, cuts: list[int]) -> tuple[list[tuple], bool]:
    """(messages, refused): what the proxy's server hands its handler for ``stream`` arriving in
    reads cut at ``cuts``, then EOF; refused: it closed the connection first (after an error of its
    own, 400, 431 or 501, or cutting a body it could not read; or as the request asked)."""
    from harness.memory_transport import MemoryTransport
    from kvdoctor.collect.proxy.http import ClientConnection, ProxyServer

    got: list[tuple] = []

    async def handler(req, reply):
        body = await req.read()
        got.append((req.method.encode(), req.target, _norm(req.headers), body))
        reply.respond(200, b"", [], b"ok")

    async def main() -> bool:
        conn = ClientConnection(ProxyServer(handler))
        t = MemoryTransport(conn)
        conn.connection_made(t)
        for a, b in zip([0, *cuts], [*cuts, len(stream)]):
            if t.closing:
                break
            conn.data_received(stream[a:b])
            for _ in range(4):  # the handler's task runs
                await asyncio.sleep(0)
        for _ in range(20):
            await asyncio.sleep(0)
        closed = t.closing
        conn.connection_lost(None)
        for _ in range(4):
            await asyncio.sleep(0)
        return closed

    import asyncio

    refused = asyncio.run(main())
    return got, refused


def _norm(headers) -> list[tuple[bytes, bytes]]:
    """Header names lower-cased, values without optional white space (RFC 9110 5.5): both sides agree on
    the field, not on how it was spaced."""
    return [(bytes(k).lower(), bytes(v).strip(b" \t")) for k, v in headers]


def _h11_server_frames(stream: bytes) -> tuple[list[tuple], str | None]:
    """(messages, error): what h11, as a server, reads from ``stream`` then EOF, answering each."""
    from urllib.parse import urlsplit

    c = h11.Connection(h11.SERVER)
    c.receive_data(stream)
    c.receive_data(b"")
    out, cur = [], None
    try:
        while True:
            ev = c.next_event()
            if isinstance(ev, h11.Request):
                target = bytes(ev.target)
                if not target.startswith(b"/") and target != b"*":  # absolute-form: the proxy keeps the path
                    u = urlsplit(target)
                    target = (u.path or b"/") + (b"?" + u.query if u.query else b"")
                cur = [bytes(ev.method), target, _norm(ev.headers.raw_items()), b""]
            elif isinstance(ev, h11.Data):
                cur[3] += bytes(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                out.append(tuple(cur))
                c.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
                c.send(h11.EndOfMessage())
                if c.our_state is not h11.DONE or c.their_state is not h11.DONE:
                    return out, None  # the connection closes (HTTP/1.0, Connection: close) or switches protocol
                c.start_next_cycle()
            else:  # NEED_DATA (a message cut short), PAUSED (an upgrade), ConnectionClosed
                return out, None
    except h11.RemoteProtocolError as e:
        return out, str(e)


@DIFF
@given(st.lists(http_requests(), min_size=1, max_size=3), st.binary(max_size=6), st.data())
@example([b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-Forwarded-For: 1\r\n\r\n"],
         b"", None)  # a trailer is not a header (found by this test: it was forwarded as one)
@example([b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"], b"", None)
def test_the_proxy_server_frames_requests_as_h11_does(requests, tail, data):
    stream = b"".join(requests) + tail
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(stream) - 1)), max_size=3)))) if data else []
    ours, refused = _proxy_server_frames(stream, cuts)
    theirs, error = _h11_server_frames(stream)
    n = min(len(ours), len(theirs))
    assert ours[:n] == theirs[:n], (stream, cuts)
    if len(ours) > len(theirs):  # the proxy took a message h11 would not: only for a reason framing ignores
        assert error is not None and error.startswith(BENIGN_REQUEST), (stream, error, ours[n:])
    elif len(ours) < len(theirs):  # it refused what h11 took: stricter is safe, but it must say so
        assert refused, (stream, theirs[n:])


_STATUS_LINES = _mostly([b"HTTP/1.1 200 OK", b"HTTP/1.1 404 Not Found", b"HTTP/1.1 200 ", b"HTTP/1.0 200 OK",
                         b"HTTP/1.1 204 No Content", b"HTTP/1.1 304 Not Modified", b"HTTP/1.1 503 Busy"],
                        [b"HTTP/1.1 200", b"HTTP/1.1 2000 OK", b"HTTP/2 200 OK", b"HTTP/1.1  200 OK", b"ICY 200 OK",
                         b"HTTP/1.1 101 Switching Protocols", b"HTTP/1.1 200 caf\xc3\xa9", b""])
_RESPONSE_NAMES = _mostly([b"Content-Type", b"Server", b"X-A", b"Connection", b"Date"],
                          [b"Content-Length", b"Transfer-Encoding", b"content-length", b"X A", b" X-A", b""], 0.1)


@st.composite
def http_responses(draw) -> bytes:
    """One response (after an interim 103 now and then), mostly well-formed, with the odd part drawn in."""
    eol = draw(EOLS)
    interim = draw(_mostly([b""], [b"HTTP/1.1 103 Early Hints" + eol + b"Link: </a>" + eol + eol,
                                   b"HTTP/1.1 100 Continue" + eol + eol]))
    headers = draw(st.lists(st.tuples(_RESPONSE_NAMES, _VALUES), max_size=3))
    body = _frame(draw, headers, draw(st.binary(max_size=24)), "close",
                  _mostly([b"chunked"], [b"gzip, chunked", b"chunked, gzip", b"identity"]))
    sep = draw(_mostly([b": ", b":"], [b":  ", b" : "]))
    return interim + draw(_STATUS_LINES) + eol + b"".join(k + sep + v + eol for k, v in headers) + eol + body


def _proxy_client_frames(response: bytes, method: bytes, cuts: list[int]) -> tuple:
    """What the proxy's upstream client makes of ``response`` (arriving in reads cut at ``cuts``, then
    EOF) to a ``method`` request: (status, headers, body), or ("error", why)."""
    import asyncio
    import time

    from harness.memory_transport import MemoryTransport
    from kvdoctor.collect.proxy.http import UpstreamClient, UpstreamConnection, UpstreamError

    async def main():
        client = UpstreamClient("http://127.0.0.1:9")
        conn = UpstreamConnection(asyncio.get_running_loop())
        conn.connection_made(MemoryTransport())
        conn.idle_since = time.monotonic()
        client._idle.append(conn)  # as if pooled: begin() writes on it
        r = client.begin(method, b"/", [], b"")
        for a, b in zip([0, *cuts], [*cuts, len(response)]):
            conn.data_received(response[a:b])
        conn.connection_lost(None)
        try:
            up = await client.head(r)
            body = b""
            while chunk := await up.read():
                body += chunk
        except UpstreamError as e:
            return ("error", f"{type(e).__name__}: {e}")
        return (up.status, _norm(up.headers), body)

    return asyncio.run(main())


def _h11_client_frames(response: bytes, method: bytes) -> tuple:
    """What h11, as the client of a ``method`` request, reads from ``response`` then EOF."""
    c = h11.Connection(h11.CLIENT)
    c.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
    c.send(h11.EndOfMessage())
    c.receive_data(response)
    c.receive_data(b"")
    status = headers = None
    body = b""
    try:
        while True:
            ev = c.next_event()
            if isinstance(ev, h11.Response):
                status, headers = ev.status_code, _norm(ev.headers.raw_items())
            elif isinstance(ev, h11.Data):
                body += bytes(ev.data)
            elif isinstance(ev, h11.EndOfMessage):
                return (status, headers, body)
            elif not isinstance(ev, h11.InformationalResponse):  # NEED_DATA: cut short; PAUSED: 101
                return ("error", f"h11: {ev}")
    except h11.RemoteProtocolError as e:
        return ("error", f"h11: {e}")


@DIFF
@given(http_responses(), _mostly([b"GET", b"POST"], [b"HEAD"], 0.15), st.data())
@example(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", b"GET", None)
def test_the_proxy_client_frames_responses_as_h11_does(response, method, data):
    """A response both read is the same response (status, headers, body); one the proxy's client reads
    and h11 refuses does not exist; the client may refuse more than h11 (a 502 to the client)."""
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(response) - 1)), max_size=3)))) if data else []
    ours = _proxy_client_frames(response, method, cuts)
    theirs = _h11_client_frames(response, method)
    if ours[0] != "error":
        assert ours == theirs, (response, method, cuts)
