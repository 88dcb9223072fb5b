"""NvmlCollector on recorded NVML readings (tests/data/nvml, written from real nvidia-smi captures)."""
import dataclasses
import importlib.machinery
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kvdoctor.collect.base import PolledCollector, SourceUnavailable
from kvdoctor.collect.nvml import FIELDS, NvmlCollector, ReplayNvml
from kvdoctor.model import GpuSample

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "nvml"
MiB = 1 << 20


def collector(name, **kw):
    return NvmlCollector(nvml=ReplayNvml(DATA / f"{name}.json"), **kw)


def test_recordings_are_well_formed():
    names = sorted(p.stem for p in DATA.glob("*.json"))
    assert {"h100-sxm-serving", "t4", "a100-mig"} <= set(names)
    calls = {f.label for f in FIELDS}
    for name in names:
        rec = json.loads((DATA / f"{name}.json").read_text())
        assert rec["format"] == "kvdoctor-nvml-recording/1" and rec["source"]
        for dev in rec["devices"]:
            assert calls <= set(dev["calls"]), (name, calls - set(dev["calls"]))


def test_h100_serving():
    c = collector("h100-sxm-serving", server_pids=lambda: {31402, 777})
    assert isinstance(c, PolledCollector) and c.name == "nvml" and c.interval_s == 0.1
    first = c.collect(100.0)
    assert [s.gpu_index for s in first] == [0, 1] and all(isinstance(s, GpuSample) for s in first)
    busy, idle = first
    assert busy.time_s == 100.0 and busy.name == "NVIDIA H100 80GB HBM3"
    assert busy.mem_total_bytes == 81559 * MiB and busy.mem_used_bytes == (58333 + 328) * MiB
    assert busy.sm_util_frac == 1.0 and busy.mem_util_frac == pytest.approx(0.41)
    assert busy.power_w == pytest.approx(699.0)
    assert (busy.sm_clock_mhz, busy.mem_clock_mhz) == (1980.0, 2619.0)
    assert busy.server_proc_mem_bytes == 58312 * MiB  # pid 29001 is not the server's
    assert busy.dram_bw_util_frac is None  # GPM needs two samples
    assert idle.uuid == "GPU-10f35015-e921-bfab-2eb8-4e9b6664d5f1"
    assert idle.power_w == pytest.approx(72.02) and idle.sm_clock_mhz == 345.0 and idle.server_proc_mem_bytes == 0

    second = c.collect(100.1)
    assert second[0].dram_bw_util_frac == pytest.approx(0.638) and second[1].dram_bw_util_frac == 0.0
    later = [c.collect(100.0 + k / 10) for k in range(2, 10)]
    assert [s[0].dram_bw_util_frac for s in later] == pytest.approx([0.661, 0.619, 0.674, 0.642, 0.65, 0.627,
                                                                     0.668, 0.635])
    assert [s[0].sm_clock_mhz for s in later][:3] == [1965.0, 1980.0, 1950.0]
    assert c.unavailable == {(0, "power_w"): "nvmlDeviceGetPowerUsage: Unknown"}
    c.close()


def test_transient_error_degrades_once_and_recovers(caplog):
    c = collector("h100-sxm-serving")
    with caplog.at_level(logging.INFO, logger="kvdoctor.collect.nvml"):
        power = [c.collect(k / 10)[0].power_w for k in range(10)]
        c.collect(1.0)
    assert power[5:8] == [698.0, None, 699.0]
    warnings = [r for r in caplog.records if "power_w" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "gpu 0: power_w n/a (nvmlDeviceGetPowerUsage: Unknown)" in warnings[0].getMessage()


def test_t4_without_gpm_and_process_memory(caplog):
    with caplog.at_level(logging.INFO, logger="kvdoctor.collect.nvml"):
        c = collector("t4", server_pids=lambda: {5762})
        samples = [c.collect(float(k))[0] for k in range(3)]
    s = samples[-1]
    assert s.name == "Tesla T4" and s.mem_total_bytes == 15360 * MiB and s.mem_used_bytes == (15360 - 13939) * MiB
    assert (s.sm_util_frac, s.mem_util_frac, s.power_w) == (0.0, 0.0, pytest.approx(26.78))
    assert (s.sm_clock_mhz, s.mem_clock_mhz) == (585.0, 5000.0)
    assert s.server_proc_mem_bytes == 1005 * MiB
    assert all(x.dram_bw_util_frac is None for x in samples)
    assert c.unavailable == {(0, "dram_bw_util_frac"): "nvmlGpmQueryDeviceSupport: FunctionNotFound"}
    assert sum("dram_bw_util_frac" in r.getMessage() for r in caplog.records) == 1


def test_a100_mig_utilization_not_supported_is_not_retried():
    nv = ReplayNvml(DATA / "a100-mig.json")
    c = NvmlCollector(nvml=nv)
    samples = [c.collect(float(k))[0] for k in range(3)]
    assert all(s.sm_util_frac is None and s.mem_util_frac is None for s in samples)
    assert samples[0].power_w == pytest.approx(67.03) and samples[0].mem_clock_mhz == 1593.0
    assert samples[0].server_proc_mem_bytes is None  # no server pids given: not read
    assert nv._cursor[(0, "nvmlDeviceGetUtilizationRates")] == 1  # NotSupported: asked once
    assert (0, "nvmlDeviceGetComputeRunningProcesses") not in nv._cursor
    assert c.unavailable[(0, "dram_bw_util_frac")].startswith("GPM not supported")
    assert c.unavailable[(0, "sm_util_frac")] == "nvmlDeviceGetUtilizationRates: NotSupported"


def test_server_pids_unknown():
    def not_found():
        raise SourceUnavailable("server not found")

    for pids in (not_found, set):
        [s] = collector("t4", server_pids=pids).collect(0.0)
        assert s.server_proc_mem_bytes is None


def test_gpu_selection_and_absence(monkeypatch):
    assert [s.gpu_index for s in collector("h100-sxm-serving", gpus=[1]).collect(0.0)] == [1]
    c = collector("h100-sxm-serving", gpus="1,0")
    assert [s.gpu_index for s in c.collect(0.0)] == [1, 0]
    c.close()
    assert len(c.collect(0.1)) == 2  # reopened after close
    with pytest.raises(ValueError, match="gpus: expected"):
        NvmlCollector(gpus="all")
    with pytest.raises(SourceUnavailable, match=r"GPU 5 not found: NVML sees 2 GPU\(s\)"):
        collector("h100-sxm-serving", gpus=[5]).collect(0.0)
    with pytest.raises(SourceUnavailable, match="gpus=none"):
        NvmlCollector(gpus="none").collect(0.0)
    no_driver = ReplayNvml({"format": "kvdoctor-nvml-recording/1", "devices": [], "init_error": "DriverNotLoaded"})
    c = NvmlCollector(nvml=no_driver)
    for _ in range(2):  # the failure is remembered, not retried at 10 Hz
        with pytest.raises(SourceUnavailable, match="NVML not available: DriverNotLoaded"):
            c.collect(0.0)
    with pytest.raises(SourceUnavailable, match="no NVIDIA GPU found"):
        NvmlCollector(nvml=ReplayNvml({"devices": []})).collect(0.0)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(SourceUnavailable, match="NVML not available: .*nvidia-ml-py"):
        NvmlCollector().collect(0.0)


def test_real_pynvml_without_a_gpu():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        with pytest.raises(SourceUnavailable, match="NVML not available"):
            NvmlCollector().collect(0.0)
    else:
        pynvml.nvmlShutdown()
        samples = NvmlCollector().collect(0.0)
        assert samples and samples[0].mem_total_bytes > 0


def test_gpm_sample_error_resets_the_pair():
    rec = json.loads((DATA / "h100-sxm-serving.json").read_text())
    calls = rec["devices"][0]["calls"]
    calls["nvmlGpmSampleGet"] = [None, None, {"error": "GpuIsLost"}, None, None]
    c = NvmlCollector(nvml=ReplayNvml(rec), gpus=[0])
    bw = [c.collect(float(k))[0].dram_bw_util_frac for k in range(5)]
    assert bw[0] is None and bw[1] == pytest.approx(0.638)
    assert bw[2] is None and bw[3] is None  # the failed sample breaks the pair; 3 starts a new one
    assert bw[4] == pytest.approx(0.674)
    assert c.unavailable[(0, "dram_bw_util_frac")] == "nvmlGpmSampleGet: GpuIsLost"

    calls["nvmlGpmSampleGet"] = [{"error": "NotSupported"}]  # e.g. the parent of MIG instances
    nv = ReplayNvml(rec)
    c = NvmlCollector(nvml=nv, gpus=[0])
    assert [c.collect(float(k))[0].dram_bw_util_frac for k in range(3)] == [None] * 3
    assert nv._cursor[(0, "nvmlGpmSampleGet")] == 1


def test_replay_loops_for_demos():
    c = NvmlCollector(nvml=ReplayNvml(DATA / "t4.json", loop=True))
    assert len([c.collect(float(k)) for k in range(7)]) == 7
    c = NvmlCollector(nvml=ReplayNvml(DATA / "h100-sxm-serving.json", loop=True), gpus=[0])
    bw = [c.collect(float(k))[0].dram_bw_util_frac for k in range(12)]
    assert bw[10] is None and bw[11] == pytest.approx(0.638)  # entry 0 of the GPM list is unused


def load_script():
    loader = importlib.machinery.SourceFileLoader("record_nvml", str(ROOT / "scripts" / "record-nvml"))
    spec = importlib.util.spec_from_loader("record_nvml", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["h100-sxm-serving", "t4", "a100-mig"])
def test_record_script_round_trip(name):
    """record-nvml's recording of a (replayed) NVML replays to the same samples."""
    rec = load_script()
    fake_time = iter(range(1000))
    recording, samples = rec.record(ReplayNvml(DATA / f"{name}.json"), seconds=1.0, hz=10, sleep=lambda s: None,
                                    server_pids=lambda: {31402, 5762}, clock=lambda: float(next(fake_time)))
    assert recording["format"] == "kvdoctor-nvml-recording/1" and len(samples) % 10 == 0
    json.dumps(recording)
    c = NvmlCollector(nvml=ReplayNvml(recording), server_pids=lambda: {31402, 5762})
    again = [s for k in range(10) for s in c.collect(0.0)]
    assert [dataclasses.replace(s, time_s=0.0) for s in samples] == again
    assert samples[-1].time_s > samples[0].time_s  # stamped by the script's clock


def test_record_script_without_nvml(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "record-nvml"), "--seconds", "0.1",
                          "-o", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=60)
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML")
    except Exception:  # noqa: BLE001
        pass
    assert out.returncode in (1, 2), out.stderr
    assert "NVML not available" in out.stderr or "pynvml not importable" in out.stderr
