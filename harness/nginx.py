"""nginx as a real reverse proxy in tests and benchmarks (Debian ``nginx-light``): the proxy
benchmark's baseline, and a bearer-token gate in front of Prometheus in the fleet tests."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
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
    from .server_base import free_port, wait_listening

    tmp = Path(tempfile.mkdtemp(prefix="kvd-nginx-"))
    port = free_port()
    try:
        cmd = write_conf(tmp, servers(port))
        if not cmd:
            yield None
            return
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_listening(port, timeout_s, proc, f"nginx (config in {tmp}) not")
            yield port
        finally:
            proc.terminate()
            proc.wait(10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
