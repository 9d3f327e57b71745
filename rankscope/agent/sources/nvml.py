"""GPU health from NVML (pynvml, PyPI nvidia-ml-py): clocks, throttle reasons, power, heat, errors.

Sampled per GPU; each window reports the mean of its samples and the counters added during it, under the
names of DCGM's fields (the vocabulary of GPU fleet dashboards):
    DCGM_FI_DEV_SM_CLOCK -> sm_clock_mhz          DCGM_FI_DEV_MAX_SM_CLOCK -> max_sm_clock_mhz
    DCGM_FI_DEV_CLOCK_THROTTLE_REASONS -> throttle_reasons
    DCGM_FI_DEV_POWER_USAGE -> power_w             DCGM_FI_DEV_GPU_TEMP -> temperature_c
    DCGM_FI_DEV_GPU_UTIL -> util_gpu_pct           DCGM_FI_DEV_FB_USED -> mem_used_mib
    DCGM_FI_DEV_PCIE_TX_THROUGHPUT / _RX_ -> pcie_tx_mbps / pcie_rx_mbps (NVML gives KB/s)
    DCGM_FI_DEV_NVLINK_{CRC_FLIT,CRC_DATA,REPLAY,RECOVERY}_ERROR_COUNT_TOTAL (summed) -> nvlink_errors
    DCGM_FI_DEV_ECC_DBE_VOL_TOTAL -> ecc_dbe       DCGM_FI_DEV_XID_ERRORS -> xids
The reader takes any object with pynvml's functions and constants, so tests replay recorded readings.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from rankscope.schema.patterns import GpuHealth

log = logging.getLogger(__name__)


@dataclass
class _Window:
    """One GPU's samples since the last window."""

    samples: int = 0
    sm_clock: float = 0.0  # sums, divided by samples at the window's end
    power_mw: float = 0.0
    temperature: float = 0.0
    util: float = 0.0
    reasons: int = 0
    mem_used: int = 0  # last sample
    pcie_tx_kbps: int = 0
    pcie_rx_kbps: int = 0
    xids: list[int] = field(default_factory=list)


@dataclass
class _Device:
    index: int
    handle: Any
    max_sm_clock: int
    nvlink_errors: int  # counters at the last window's end
    ecc_dbe: int
    window: _Window = field(default_factory=_Window)


class GpuHealthReader:
    def __init__(self, nvml: Any | None = None):
        """`nvml`: pynvml or a stand-in; None imports pynvml. Without NVML the reader is unavailable (said
        once in the log) and every call returns nothing."""
        self.devices: list[_Device] = []
        self._events = None
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                log.info("pynvml is not installed: GPU health is not reported")
                self.nvml = None
                return
        self.nvml = nvml
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as e:
            log.info("no NVML on this machine (%s): GPU health is not reported", e)
            self.nvml = None
            return
        for i in range(count):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            self.devices.append(_Device(i, h, self._get(nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_SM),
                                        self._nvlink_errors(h), self._ecc_dbe(h)))
        self._events = self._xid_events()

    @property
    def available(self) -> bool:
        return self.nvml is not None

    def _get(self, fn, *args, default: Any = 0) -> Any:
        """One reading; a feature this GPU lacks (NVLink on PCIe cards, ECC on consumer ones) reads as default."""
        try:
            return fn(*args)
        except self.nvml.NVMLError:
            return default

    def _nvlink_errors(self, handle) -> int:
        n = self.nvml
        total = 0
        for link in range(n.NVML_NVLINK_MAX_LINKS):
            if self._get(n.nvmlDeviceGetNvLinkState, handle, link, default=None) is None:
                continue  # no such link
            for counter in (n.NVML_NVLINK_ERROR_DL_REPLAY, n.NVML_NVLINK_ERROR_DL_RECOVERY,
                            n.NVML_NVLINK_ERROR_DL_CRC_FLIT, n.NVML_NVLINK_ERROR_DL_CRC_DATA):
                total += self._get(n.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter)
        return total

    def _ecc_dbe(self, handle) -> int:
        n = self.nvml
        return self._get(n.nvmlDeviceGetTotalEccErrors, handle, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                         n.NVML_VOLATILE_ECC)

    def _xid_events(self):
        n = self.nvml
        try:
            events = n.nvmlEventSetCreate()
            for d in self.devices:
                n.nvmlDeviceRegisterEvents(d.handle, n.nvmlEventTypeXidCriticalError, events)
            return events
        except n.NVMLError as e:
            log.info("NVML XID events unavailable (%s): XIDs are not reported", e)
            return None

    def sample(self) -> None:
        """Read every GPU once into the current window; drain pending XID events."""
        if not self.available:
            return
        n = self.nvml
        reasons_fn = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            n.nvmlDeviceGetCurrentClocksThrottleReasons
        ignored = (n.nvmlClocksEventReasonGpuIdle | n.nvmlClocksEventReasonApplicationsClocksSetting
                   | n.nvmlClocksEventReasonDisplayClockSetting)  # not slowdowns
        for d in self.devices:
            w, h = d.window, d.handle
            w.samples += 1
            w.sm_clock += self._get(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM)
            w.power_mw += self._get(n.nvmlDeviceGetPowerUsage, h)
            w.temperature += self._get(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU)
            util = self._get(n.nvmlDeviceGetUtilizationRates, h, default=None)
            w.util += util.gpu if util is not None else 0
            w.reasons |= self._get(reasons_fn, h) & ~ignored
            mem = self._get(n.nvmlDeviceGetMemoryInfo, h, default=None)
            w.mem_used = mem.used if mem is not None else 0
            w.pcie_tx_kbps = self._get(n.nvmlDeviceGetPcieThroughput, h, n.NVML_PCIE_UTIL_TX_BYTES)
            w.pcie_rx_kbps = self._get(n.nvmlDeviceGetPcieThroughput, h, n.NVML_PCIE_UTIL_RX_BYTES)
        self._drain_xids()

    def _drain_xids(self) -> None:
        if self._events is None:
            return
        n = self.nvml
        while True:
            try:
                data = n.nvmlEventSetWait_v2(self._events, 0)
            except n.NVMLError:  # NVMLError_Timeout: nothing pending
                return
            # An event's handle is a new ctypes object: identify its GPU by index, not by handle.
            index = self._get(n.nvmlDeviceGetIndex, data.device, default=None)
            if index is not None and 0 <= index < len(self.devices):
                self.devices[index].window.xids.append(int(data.eventData))

    def window(self) -> dict[int, GpuHealth]:
        """Each GPU's health over the window since the previous call (GPUs not sampled are left out)."""
        out = {}
        for d in self.devices:
            w = d.window
            if not w.samples:
                continue
            nvlink, ecc = self._nvlink_errors(d.handle), self._ecc_dbe(d.handle)
            out[d.index] = GpuHealth(
                index=d.index, sm_clock_mhz=round(w.sm_clock / w.samples), max_sm_clock_mhz=d.max_sm_clock,
                throttle_reasons=w.reasons, power_w=round(w.power_mw / w.samples / 1000),
                temperature_c=round(w.temperature / w.samples), util_gpu_pct=round(w.util / w.samples),
                mem_used_mib=w.mem_used >> 20, pcie_tx_mbps=w.pcie_tx_kbps // 1000,
                pcie_rx_mbps=w.pcie_rx_kbps // 1000, nvlink_errors=max(nvlink - d.nvlink_errors, 0),
                ecc_dbe=max(ecc - d.ecc_dbe, 0), xids=w.xids[:8])
            d.nvlink_errors, d.ecc_dbe, d.window = nvlink, ecc, _Window()
        return out

    def device_of(self) -> dict[int, int]:
        """pid -> index of the GPU it computes on (the first one listing it; host pids)."""
        out: dict[int, int] = {}
        for d in self.devices:
            for proc in self._get(self.nvml.nvmlDeviceGetComputeRunningProcesses, d.handle, default=[]):
                out.setdefault(proc.pid, d.index)
        return out

    def close(self) -> None:
        if self.available:
            if self._events is not None:
                self._get(self.nvml.nvmlEventSetFree, self._events)
            self._get(self.nvml.nvmlShutdown)
            self.nvml = None
