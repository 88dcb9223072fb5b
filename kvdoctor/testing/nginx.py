"""nginx as a real reverse proxy in tests and benchmarks (Debian ``nginx-light``): the proxy
benchmark's baseline, and a bearer-token gate in front of Prometheus in the fleet tests."""
from __future__ import annotations

import os
import shutil
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
