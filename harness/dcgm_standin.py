"""A DCGM exporter stand-in for tests on machines without a GPU.

It serves a *recorded* dcgm-exporter scrape (every family, label and help text as the real
exporter wrote them; tests use DataDog's fixture in tests/data/metrics) on ``/metrics``, with the
values that matter to kvdoctor driven by a co-located llama-server's real load: the share of its
slots that are busy (``llamacpp:requests_processing`` over ``--parallel``) sets DRAM activity,
memory-copy and GPU utilisation and part of the framebuffer in use. The ``Hostname`` label is
rewritten to the host it stands beside, as the real exporter reports its node.

What it is not: a GPU. Its numbers follow load the way a bandwidth-bound decoder's would; they
are not measurements. kvdoctor's NVML path is tested on recorded NVML readings instead.
"""
from __future__ import annotations

import re
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

#: value of each driven family as a function of busy share b (0..1) and the GPU's total MiB
DRIVEN = {
    "DCGM_FI_PROF_DRAM_ACTIVE": lambda b, total: 0.05 + 0.85 * b,
    "DCGM_FI_DEV_MEM_COPY_UTIL": lambda b, total: round(5 + 85 * b),
    "DCGM_FI_DEV_GPU_UTIL": lambda b, total: round(3 + 95 * b),
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": lambda b, total: 0.03 + 0.9 * b,
    "DCGM_FI_DEV_FB_USED": lambda b, total: round(0.55 * total + 0.25 * total * b),
    "DCGM_FI_DEV_FB_FREE": lambda b, total: round(total - (0.55 * total + 0.25 * total * b)),
}
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)\s*$")


def busy_share(server_url: str, slots: int) -> float:
    """Busy slots / slots from the server's /metrics (0 when it does not answer)."""
    try:
        text = urllib.request.urlopen(server_url.rstrip("/") + "/metrics", timeout=2).read().decode()
    except OSError:
        return 0.0
    m = re.search(r"^llamacpp:requests_processing\s+(\S+)", text, re.M)
    return min(1.0, float(m[1]) / max(slots, 1)) if m else 0.0


def render(recorded: str, busy: float, hostname: str) -> str:
    """The recorded scrape with the driven families' values replaced and Hostname set."""
    total = 15360.0
    m = re.search(r"^DCGM_FI_DEV_FB_TOTAL(?:\{.*\})?\s+(\S+)", recorded, re.M)
    if m and float(m[1]) > 0:
        total = float(m[1])
    out = []
    for line in recorded.splitlines():
        s = _SAMPLE.match(line)
        if s and not line.startswith("#"):
            name, labels, value = s[1], s[2] or "", s[3]
            labels = re.sub(r'Hostname="[^"]*"', f'Hostname="{hostname}"', labels)
            if name in DRIVEN:
                value = f"{DRIVEN[name](busy, total):g}"
            line = f"{name}{labels} {value}"
        out.append(line)
    return "\n".join(out) + "\n"


class DcgmStandIn:
    """``with DcgmStandIn(fixture, host, server_url, slots) as d: d.url``: an HTTP /metrics
    endpoint on ``host`` (a loopback address) answering like dcgm-exporter next to that server."""

    def __init__(self, fixture: str | Path, host: str, server_url: str, slots: int, hostname: str | None = None):
        self.recorded = Path(fixture).read_text()
        self.host, self.server_url, self.slots = host, server_url, slots
        self.hostname = hostname or host
        me = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = render(me.recorded, busy_share(me.server_url, me.slots), me.hostname).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._httpd = ThreadingHTTPServer((host, 0), Handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "DcgmStandIn":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
