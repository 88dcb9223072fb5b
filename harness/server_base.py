"""A managed OpenAI-compatible server subprocess on a loopback address, for tests and benchmarks.

:class:`ManagedServer` owns what every engine harness shares: a free port, a log file, start
and wait for ``GET /health`` == 200, stop (SIGTERM to the process group, SIGKILL after a
timeout), restart on the same port, and a context manager. Subclasses give the command line
(:meth:`ManagedServer.cmdline`), optionally an environment (:meth:`ManagedServer.env`), and
their engine's own facts.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout_s: float = 20.0, proc: subprocess.Popen | None = None,
                   what: str = "nothing") -> None:
    """Return once something accepts connections on 127.0.0.1:``port``; TimeoutError after
    ``timeout_s``, or at once when ``proc`` (the process that should listen) has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                raise TimeoutError(f"{what} listening on 127.0.0.1:{port}") from None
            time.sleep(0.05)


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the process that started it dies, so a killed test
    run or timed-out script never leaves a server spinning on the CPUs."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ManagedServer:
    """A server child process on 127.0.0.0/8 in a session of its own; a context manager."""

    #: the engine's name in error messages
    engine_name = "server"
    #: how often to ask /health while starting
    poll_s = 0.5
    #: SIGTERM grace before SIGKILL in :meth:`stop`
    stop_timeout_s = 10.0
    #: the server leaves children (e.g. vLLM's engine core) that may outlive it: SIGKILL the
    #: process group after every stop, not only when the server ignored SIGTERM
    kill_group_after_stop = False

    def __init__(self, host: str, port: int | None, startup_timeout_s: float, log_prefix: str) -> None:
        if not host.startswith("127."):  # any loopback address: tests give each "host" its own
            raise ValueError(f"{type(self).__name__} only listens on a loopback address (127.0.0.0/8)")
        self.host = host
        self._auto_port = port is None
        self.port: int = port if port is not None else free_port(host)
        self.startup_timeout_s = startup_timeout_s
        fd, log = tempfile.mkstemp(prefix=log_prefix, suffix=".log")
        os.close(fd)
        self.log_path = Path(log)
        self._proc: subprocess.Popen | None = None
        self._log_fh = None

    # -- what a subclass gives
    def cmdline(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict | None:
        """The server's environment (None: this process's)."""
        return None

    # -- properties
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle
    def start(self):
        if not self.running:
            self._spawn_and_wait()
        return self

    def _spawn_and_wait(self) -> None:
        cmd = self.cmdline()
        self._log_fh = open(self.log_path, "ab")
        self._log_fh.write(f"\n$ {' '.join(cmd)}\n".encode())
        self._log_fh.flush()
        self._proc = subprocess.Popen(cmd, stdout=self._log_fh, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=self.env(), start_new_session=True,
                                      preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                rc = self._proc.returncode
                self.stop()
                raise RuntimeError(f"{self.engine_name} exited with {rc} during startup; "
                                   f"log tail:\n{self.log_tail()}")
            if self.health() == 200:
                return
            time.sleep(self.poll_s)
        self.stop()
        raise RuntimeError(f"{self.engine_name} not healthy after {self.startup_timeout_s:.0f}s; "
                           f"log tail:\n{self.log_tail()}")

    def health(self, timeout_s: float = 2.0) -> int | None:
        """HTTP status of ``GET /health`` (None if unreachable)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return None

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM to the process group, then SIGKILL after ``timeout_s`` (default ``stop_timeout_s``)."""
        p = self._proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=self.stop_timeout_s if timeout_s is None else timeout_s)
        if p is not None and (p.poll() is None or self.kill_group_after_stop):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    def restart(self):
        """Stop and start again on the same port (KV cache and counters are reset)."""
        self.stop()
        self._auto_port = False  # keep the port
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # wait until the old socket is released
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((self.host, self.port))
                    break
                except OSError:
                    time.sleep(0.1)
        return self.start()

    # -- the log and small HTTP helpers
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, str]:
        """``(status, body)`` of ``GET url+path``."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:  # best effort: never leave a server behind
        with contextlib.suppress(Exception):
            self.stop(timeout_s=2)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, pid={self.pid}, running={self.running})"
