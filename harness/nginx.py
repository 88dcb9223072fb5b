"""nginx as a real reverse proxy in tests and benchmarks (Debian ``nginx-light``): the proxy
benchmark's baseline, and a bearer-token gate in front of Prometheus in the fleet tests."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CONF = """
worker_processes 1;
daemon off;
master_process on;
user {user};
error_log {tmp}/error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    {servers}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


def write_conf(tmp: Path, servers: str) -> list[str]:
    """Write ``tmp/nginx.conf`` with these ``server``/``upstream`` blocks; returns the command
    line that runs nginx in the foreground on it (or [] when nginx is not installed)."""
    exe = nginx_binary()
    if not exe:
        return []
    user = "root" if os.geteuid() == 0 else os.environ.get("USER", "nobody")
    conf = CONF.format(tmp=tmp, servers=servers, user=user)
    if os.geteuid() != 0:
        conf = conf.replace(f"user {user};\n", "")
    (tmp / "nginx.conf").write_text(conf)
    return [exe, "-c", str(tmp / "nginx.conf"), "-p", str(tmp)]


@contextlib.contextmanager
def running(servers: Callable[[int], str], timeout_s: float = 20.0) -> Iterator[int | None]:
    """nginx in the foreground on a temp config whose ``server``/``upstream`` blocks are
    ``servers(port)``, for a free ``port``; yields that port once nginx listens (None when nginx
    is not installed) and stops nginx on exit."""
    from .server_base import free_port

    tmp = Path(tempfile.mkdtemp(prefix="kvd-nginx-"))
    port = free_port()
    try:
        cmd = write_conf(tmp, servers(port))
        if not cmd:
            yield None
            return
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise TimeoutError(f"nginx did not listen on 127.0.0.1:{port} (config in {tmp})") from None
                    time.sleep(0.05)
            yield port
        finally:
            proc.terminate()
            proc.wait(10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
