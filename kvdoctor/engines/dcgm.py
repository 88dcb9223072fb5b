"""NVIDIA DCGM exporter names → neutral GPU names.

Verified against NVIDIA/dcgm-exporter ``etc/default-counters.csv`` (units in the help text:
framebuffer in MiB, ``*_UTIL`` in percent, ``DCGM_FI_PROF_*`` activity as 0..1 ratios) and the
DataDog/integrations-core ``dcgm/tests/fixtures/metrics.txt`` scrape. One series per GPU:
memory sums over GPUs, fractions average (see neutral.py).
"""
from .neutral import EngineTable, Wire

_MIB = 1024.0 * 1024.0

TABLE = EngineTable(
    name="dcgm",
    title="DCGM exporter",
    prefixes=("DCGM_FI_",),
    metrics=(
        Wire("DCGM_FI_DEV_FB_USED", "gpu_mem_used_bytes", scale=_MIB, note="MiB"),
        Wire("DCGM_FI_DEV_FB_FREE", "gpu_mem_free_bytes", scale=_MIB, note="MiB"),
        Wire("DCGM_FI_DEV_FB_TOTAL", "gpu_mem_total_bytes", scale=_MIB, note="MiB"),
        Wire("DCGM_FI_DEV_GPU_UTIL", "gpu_util_frac", scale=0.01, note="percent"),
        Wire("DCGM_FI_DEV_MEM_COPY_UTIL", "gpu_mem_copy_util_frac", scale=0.01, note="percent"),
        Wire("DCGM_FI_PROF_DRAM_ACTIVE", "gpu_dram_active_frac", note="ratio"),
        Wire("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gpu_gr_engine_active_frac", note="ratio"),
        Wire("DCGM_FI_PROF_SM_ACTIVE", "gpu_sm_active_frac", note="ratio"),
        Wire("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gpu_tensor_active_frac", note="ratio"),
        Wire("DCGM_FI_DEV_POWER_USAGE", "gpu_power_w"),
    ),
    sources=(
        "NVIDIA/dcgm-exporter etc/default-counters.csv",
        "DataDog/integrations-core dcgm/tests/fixtures/metrics.txt",
    ),
)
