"""GPU readings through NVML (``pynvml`` from nvidia-ml-py), one GpuSample per GPU per collect.

Thin on purpose: the fields are a table (GpuSample field -> NVML call -> conversion); each call is
made once per GPU per collect however many fields it feeds. A reading that fails degrades to None
("n/a") and is logged once per (gpu, call); NotSupported / FunctionNotFound calls are not retried.
DRAM bandwidth comes from GPM (Hopper and newer) as the metric between this collect's GPM sample
and the previous one. :class:`ReplayNvml` answers the same calls from a recording (tests/data/nvml,
``scripts/record-nvml``; format in its docstring) for tests and demos.
"""
from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from ..model import GpuSample
from .base import SourceUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NvmlField:
    field: str  # GpuSample attribute
    call: str  # pynvml function, called with the device handle
    arg: str | None  # name of a pynvml constant passed after the handle
    convert: Callable[[Any], Any]

    @property
    def label(self) -> str:
        return self.call if self.arg is None else f"{self.call}({self.arg})"


FIELDS = (
    NvmlField("mem_used_bytes", "nvmlDeviceGetMemoryInfo", None, lambda m: int(m.used)),
    NvmlField("mem_total_bytes", "nvmlDeviceGetMemoryInfo", None, lambda m: int(m.total)),
    NvmlField("sm_util_frac", "nvmlDeviceGetUtilizationRates", None, lambda u: u.gpu / 100.0),
    NvmlField("mem_util_frac", "nvmlDeviceGetUtilizationRates", None, lambda u: u.memory / 100.0),
    NvmlField("power_w", "nvmlDeviceGetPowerUsage", None, lambda mw: mw / 1000.0),
    NvmlField("sm_clock_mhz", "nvmlDeviceGetClockInfo", "NVML_CLOCK_SM", float),
    NvmlField("mem_clock_mhz", "nvmlDeviceGetClockInfo", "NVML_CLOCK_MEM", float),
)
PROCS_CALL = "nvmlDeviceGetComputeRunningProcesses"  # -> server_proc_mem_bytes
GPM_METRIC = "NVML_GPM_METRIC_DRAM_BW_UTIL"  # -> dram_bw_util_frac, percent 0..100
_PERMANENT = ("NotSupported", "FunctionNotFound")
_NA = object()


def error_name(e: BaseException) -> str:
    """'NotSupported' for pynvml.NVMLError_NotSupported (the recording's error marker)."""
    return type(e).__name__.removeprefix("NVMLError_")


def _text(v: Any) -> str | None:
    return v.decode(errors="replace") if isinstance(v, bytes) else (str(v) if v is not None else None)


@dataclass(eq=False)
class _Device:
    index: int
    handle: Any
    name: str | None = None
    uuid: str | None = None
    gpm: list[Any] | None = None  # [previous, current] GPM samples when GPM is supported
    gpm_paired: bool = False
    dead: set[str] = field(default_factory=set)


class NvmlCollector:
    name = "nvml"

    def __init__(self, gpus: str | list[int] = "auto", server_pids: Callable[[], set[int]] | None = None,
                 nvml: Any = None, *, interval_s: float = 0.1):
        if isinstance(gpus, str) and gpus not in ("auto", "none"):  # "0,2" from a command line
            try:
                gpus = [int(x) for x in gpus.split(",")]
            except ValueError:
                raise ValueError(f"gpus: expected auto, none or indices like 0,1; got {gpus!r}") from None
        self.gpus, self.server_pids, self.interval_s = gpus, server_pids, interval_s
        self._nvml, self._devices, self._failed = nvml, None, None
        #: (gpu index, GpuSample field) -> why it first read n/a (a transient error may have cleared)
        self.unavailable: dict[tuple[int, str], str] = {}

    def collect(self, now_s: float) -> list[GpuSample]:
        devices = self._open()
        pids = self._pids()
        return [self._read(d, now_s, pids) for d in devices]

    def close(self) -> None:
        if self._devices is None:
            return
        for d in self._devices:
            self._free_gpm(d)
        self._devices = self._failed = None  # a later collect opens NVML again
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass

    # -- setup
    def _open(self) -> list[_Device]:
        if self._devices is not None:
            return self._devices
        if self._failed is None:
            self._failed = self._init()
        if self._failed:
            raise SourceUnavailable(self._failed)
        return self._devices

    def _init(self) -> str:
        if self.gpus == "none":
            return "GPU sampling off (gpus=none)"
        try:
            nv = self._nvml = self._nvml or importlib.import_module("pynvml")
        except ImportError as e:
            return f"NVML not available: {e} (pip install nvidia-ml-py)"
        try:
            nv.nvmlInit()
            count = nv.nvmlDeviceGetCount()
            wanted = list(range(count)) if self.gpus == "auto" else list(self.gpus)
            if not wanted:
                return "NVML not available: no NVIDIA GPU found"
            missing = [i for i in wanted if not 0 <= i < count]
            if missing:
                return f"GPU {missing[0]} not found: NVML sees {count} GPU(s), indices 0..{count - 1}"
            devices = [_Device(i, nv.nvmlDeviceGetHandleByIndex(i)) for i in wanted]
        except nv.NVMLError as e:
            return f"NVML not available: {e}"
        for d in devices:
            d.name, d.uuid = (None if v is _NA else _text(v)
                              for v in (self._call(d, "nvmlDeviceGetName"), self._call(d, "nvmlDeviceGetUUID")))
            self._init_gpm(d)
        self._devices = devices
        return ""

    def _init_gpm(self, d: _Device) -> None:
        support = self._call(d, "nvmlGpmQueryDeviceSupport", field="dram_bw_util_frac")
        if support is _NA:
            return
        if not getattr(support, "isSupportedDevice", 0):
            self._na(d, "dram_bw_util_frac", "GPM not supported on this GPU (Hopper and newer)", quiet=True)
            return
        try:
            d.gpm = [self._nvml.nvmlGpmSampleAlloc(), self._nvml.nvmlGpmSampleAlloc()]
        except self._nvml.NVMLError as e:
            self._na(d, "dram_bw_util_frac", f"nvmlGpmSampleAlloc: {error_name(e)}")

    def _free_gpm(self, d: _Device) -> None:
        for sample in d.gpm or ():
            try:
                self._nvml.nvmlGpmSampleFree(sample)
            except self._nvml.NVMLError:
                pass
        d.gpm = None

    # -- reading
    def _pids(self) -> set[int] | None:
        if self.server_pids is None:
            return None
        try:
            pids = self.server_pids()
        except Exception as e:  # the host collector may not have found the server (yet)
            log.debug("server pids unknown: %s", e)
            return None
        return set(pids) if pids else None

    def _read(self, d: _Device, now_s: float, pids: set[int] | None) -> GpuSample:
        results: dict[str, Any] = {}
        values: dict[str, Any] = {}
        for f in FIELDS:
            if f.label not in results:
                results[f.label] = self._call(d, f.call, f.arg)
            r = results[f.label]
            values[f.field] = None if r is _NA or r is None else f.convert(r)
        if pids is not None:
            procs = self._call(d, PROCS_CALL, field="server_proc_mem_bytes")
            if procs is not _NA:
                values["server_proc_mem_bytes"] = sum(int(p.usedGpuMemory) for p in procs
                                                      if p.pid in pids and p.usedGpuMemory is not None)
        return GpuSample(time_s=now_s, gpu_index=d.index, name=d.name, uuid=d.uuid,
                         dram_bw_util_frac=self._gpm(d), **values)

    def _gpm(self, d: _Device) -> float | None:
        if not d.gpm:
            return None
        nv = self._nvml
        try:
            nv.nvmlGpmSampleGet(d.handle, d.gpm[1])
        except nv.NVMLError as e:
            d.gpm_paired = False
            if error_name(e) in _PERMANENT:  # e.g. MIG mode: stop asking
                self._free_gpm(d)
            self._na(d, "dram_bw_util_frac", f"nvmlGpmSampleGet: {error_name(e)}")
            return None
        paired, d.gpm_paired = d.gpm_paired, True
        prev, cur = d.gpm
        d.gpm.reverse()  # this sample is the next call's previous one
        if not paired:
            return None
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version, mg.numMetrics, mg.sample1, mg.sample2 = nv.NVML_GPM_METRICS_GET_VERSION, 1, prev, cur
        mg.metrics[0].metricId = getattr(nv, GPM_METRIC)
        try:
            nv.nvmlGpmMetricsGet(mg)
        except nv.NVMLError as e:
            self._na(d, "dram_bw_util_frac", f"nvmlGpmMetricsGet: {error_name(e)}")
            return None
        m = mg.metrics[0]
        if m.nvmlReturn != nv.NVML_SUCCESS:
            self._na(d, "dram_bw_util_frac", f"nvmlGpmMetricsGet: NVML error {m.nvmlReturn}")
            return None
        return float(m.value) / 100.0

    def _call(self, d: _Device, call: str, arg: str | None = None, *, field: str | None = None) -> Any:
        """The call's result, or _NA after logging its failure once for this GPU."""
        label = call if arg is None else f"{call}({arg})"
        if label in d.dead:
            return _NA
        nv = self._nvml
        try:
            return getattr(nv, call)(d.handle, *(() if arg is None else (getattr(nv, arg),)))
        except nv.NVMLError as e:
            name = error_name(e)
            if name in _PERMANENT:
                d.dead.add(label)
            fields = [field] if field else [f.field for f in FIELDS if f.label == label] or [label]
            for fld in fields:
                self._na(d, fld, f"{label}: {name}", quiet=name in _PERMANENT)
            return _NA

    def _na(self, d: _Device, fld: str, why: str, *, quiet: bool = False) -> None:
        if (d.index, fld) not in self.unavailable:
            self.unavailable[(d.index, fld)] = why
            (log.info if quiet else log.warning)("gpu %d: %s n/a (%s)", d.index, fld, why)


# ---------------------------------------------------------------------------------------------
class ReplayNvml:
    """The pynvml subset NvmlCollector calls, answered from a recording.

    Recording (JSON)::

        {"format": "kvdoctor-nvml-recording/1", "source": "...", "interval_s": 0.1,
         "devices": [{"index": 0, "calls": {"nvmlDeviceGetMemoryInfo": [{"total": .., "free": .., "used": ..}, ..],
                                            "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)": [1980, ..],
                                            "nvmlGpmMetricsGet(NVML_GPM_METRIC_DRAM_BW_UTIL)": [null, 71.5, ..], ..}}]}

    Each call's list holds what it returned at collect 0, 1, 2, ...: raw NVML values (bytes, percent,
    milliwatts, MHz), dicts for structs (same attribute names), or ``{"error": "NotSupported"}``
    (an NVMLError_<name> is raised). Past the end the last value repeats (``loop=True``: start over).
    The GPM metric list is indexed by the collect of the later sample of the pair (entry 0 unused).
    A call missing from the recording raises NotSupported.
    """

    ERRORS = {"Uninitialized": 1, "InvalidArgument": 2, "NotSupported": 3, "NoPermission": 4, "NotFound": 6,
              "DriverNotLoaded": 9, "Timeout": 10, "LibraryNotFound": 12, "FunctionNotFound": 13,
              "GpuIsLost": 15, "Unknown": 999}
    NVML_SUCCESS, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2
    NVML_GPM_METRIC_DRAM_BW_UTIL, NVML_GPM_METRICS_GET_VERSION = 10, 1
    _CONST = {1: "NVML_CLOCK_SM", 2: "NVML_CLOCK_MEM", 10: "NVML_GPM_METRIC_DRAM_BW_UTIL"}

    class NVMLError(Exception):
        value = 999

    def __init__(self, recording: dict | str | Path, *, loop: bool = False):
        if not isinstance(recording, dict):
            recording = json.loads(Path(recording).read_text())
        self.recording, self.loop = recording, loop
        self._calls = [dev["calls"] for dev in recording["devices"]]
        self._cursor: dict[tuple[int, str], int] = {}
        for name, code in self.ERRORS.items():
            cls = type(f"NVMLError_{name}", (self.NVMLError,), {"value": code})
            setattr(self, cls.__name__, cls)

    def _raise(self, name: str):
        raise getattr(self, f"NVMLError_{name}", self.NVMLError_Unknown)(name)

    def _value(self, v: Any) -> Any:
        if isinstance(v, dict) and "error" in v:
            self._raise(v["error"])
        if isinstance(v, list):
            return [self._value(x) for x in v]
        return SimpleNamespace(**v) if isinstance(v, dict) else v

    def _at(self, index: int, call: str, k: int) -> Any:
        seq = self._calls[index].get(call)
        if not seq:
            self._raise("NotSupported")
        return self._value(seq[k % len(seq)] if self.loop else seq[min(k, len(seq) - 1)])

    def _next(self, handle: SimpleNamespace, call: str) -> Any:
        k = self._cursor.get((handle.index, call), 0)
        self._cursor[(handle.index, call)] = k + 1
        return self._at(handle.index, call, k)

    def nvmlInit(self) -> None:
        if self.recording.get("init_error"):
            self._raise(self.recording["init_error"])

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self._calls)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimpleNamespace:
        if not 0 <= index < len(self._calls):
            self._raise("InvalidArgument")
        return SimpleNamespace(index=index)

    def __getattr__(self, call: str) -> Any:  # nvmlDeviceGetName, nvmlDeviceGetMemoryInfo, ...
        if call.startswith(("nvmlDeviceGet", "nvmlGpmQuery")):
            def read(handle, *args):
                return self._next(handle, call + "".join(f"({self._CONST.get(a, a)})" for a in args))
            return read
        raise AttributeError(call)

    def nvmlGpmSampleAlloc(self) -> SimpleNamespace:
        return SimpleNamespace(index=None, tick=None)

    def nvmlGpmSampleFree(self, sample: SimpleNamespace) -> None:
        pass

    def nvmlGpmSampleGet(self, handle: SimpleNamespace, sample: SimpleNamespace) -> SimpleNamespace:
        sample.index, sample.tick = handle.index, self._cursor.get((handle.index, "nvmlGpmSampleGet"), 0)
        self._cursor[(handle.index, "nvmlGpmSampleGet")] = sample.tick + 1
        if "nvmlGpmSampleGet" in self._calls[handle.index]:
            self._at(handle.index, "nvmlGpmSampleGet", sample.tick)  # raises a recorded error
        return sample

    def c_nvmlGpmMetricsGet_t(self) -> SimpleNamespace:
        metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(8)]
        return SimpleNamespace(version=0, numMetrics=0, sample1=None, sample2=None, metrics=metrics)

    def nvmlGpmMetricsGet(self, mg: SimpleNamespace) -> SimpleNamespace:
        for m in mg.metrics[:mg.numMetrics]:
            call = f"nvmlGpmMetricsGet({self._CONST.get(m.metricId, m.metricId)})"
            try:
                v = self._at(mg.sample2.index, call, mg.sample2.tick)
            except self.NVMLError as e:
                m.nvmlReturn, m.value = e.value, 0.0
            else:
                m.nvmlReturn, m.value = (0, float(v)) if v is not None else (self.ERRORS["NotSupported"], 0.0)
        return mg
