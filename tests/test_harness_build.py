"""The llama-server build the real-server tests use must run on every machine that builds it:
no ``-march=native`` on x86-64 (a VM can list AMX that a process may not use: SIGILL at the
first matmul), only the instruction sets /proc/cpuinfo lists, and a cache folder per flavour so
an older native build is never picked up."""
import platform

import pytest

from harness import llama_build as ls


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 only")
def test_x86_build_never_native_never_amx(monkeypatch):
    monkeypatch.setattr(ls, "_cpu_flags", lambda: {"avx", "avx2", "fma", "f16c", "amx_tile", "avx512f"})
    tag, args = ls.build_flavour()
    assert tag == "x86-avx2"
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX2=ON" in args
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AVX512=OFF"} <= set(args)
    assert ls.cached_binary_path().parent.name.endswith("-x86-avx2")
    # an older CPU without AVX2 gets neither AVX2 nor a cache folder shared with AVX2 machines
    monkeypatch.setattr(ls, "_cpu_flags", lambda: {"avx", "sse4_2"})
    tag, args = ls.build_flavour()
    assert tag == "x86-avx" and "-DGGML_AVX2=ON" not in args and "-DGGML_AVX=ON" in args


def test_doc_cmake_block_is_the_build(monkeypatch):
    """docs/test-harness.md's cmake block is exactly what the build runs on an AVX2 x86-64 machine
    (paths and job count as the docs name them): a changed option in either fails here."""
    import shlex

    from conftest import doc_blocks_for

    monkeypatch.setattr(ls.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(ls, "_cpu_flags", lambda: {"avx", "avx2", "fma", "f16c", "bmi2"})
    (block,) = doc_blocks_for("docs/test-harness.md", "harness/llama_build.py")
    written = [shlex.split(cmd, comments=True) for cmd in block.replace("\\\n", " ").strip().split("\n")]
    configure, make = ls.cmake_commands("cmake", "llama.cpp", "build", "$(nproc)", ninja=True,
                                        args=ls._BASE_CMAKE_ARGS + ls.build_flavour()[1])
    assert written[0] == configure, f"docs/test-harness.md's cmake configure line differs from the build's:\n{written[0]}\n{configure}"
    assert written[1] == make, f"docs/test-harness.md's cmake build line differs from the build's:\n{written[1]}\n{make}"
    assert len(written) == 2
