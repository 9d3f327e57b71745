"""A stand-in for pynvml that replays recorded readings (tests/data/*.json): the functions the GPU health
reader calls, with pynvml's own constants and error classes, one recorded sample per `advance()`."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pynvml

READINGS = Path(__file__).with_name("data") / "nvml_readings.json"  # NVML's shapes, not recorded on a GPU


class ReplayNvml:
    def __init__(self, path: Path):
        self.data = json.loads(path.read_text())
        self.sample = 0  # the reading the next calls return
        self.pending_xids = [x for x in self.data["xids"]]

    def __getattr__(self, name: str):  # constants and error classes as pynvml defines them
        return getattr(pynvml, name)

    def advance(self) -> None:
        self.sample += 1

    def _now(self, handle: int) -> dict:
        return self.data["devices"][handle]["samples"][self.sample]

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.data["devices"])

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self.data["devices"][h]["max_sm_clock"]

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._now(h)["sm_clock"]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._now(h)["reasons"]

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._now(h)["power_mw"]

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return self._now(h)["temp"]

    def nvmlDeviceGetUtilizationRates(self, h: int):
        return SimpleNamespace(gpu=self._now(h)["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h: int):
        return SimpleNamespace(used=self._now(h)["mem_used"])

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        return self._now(h)["pcie_tx" if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else "pcie_rx"]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= self.data["devices"][h]["nvlink_links"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        # The recorded total sits on link 0, as replays; every other link and counter reads 0.
        return self._now(h)["nvlink_errors"] if link == 0 and counter == pynvml.NVML_NVLINK_ERROR_DL_REPLAY else 0

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        if self.data["devices"][h]["nvlink_links"] == 0:  # the PCIe card has no ECC
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._now(h)["ecc_dbe"]

    def nvmlEventSetCreate(self) -> str:
        return "events"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, events: str) -> None:
        assert types & pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int):
        for x in self.pending_xids:
            if x["sample"] <= self.sample:
                self.pending_xids.remove(x)
                return SimpleNamespace(device=x["device"], eventData=x["xid"],
                                       eventType=pynvml.nvmlEventTypeXidCriticalError)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, events: str) -> None:
        pass

    def nvmlDeviceGetComputeRunningProcesses(self, h: int):
        return [SimpleNamespace(pid=p, usedGpuMemory=0) for p in self.data["devices"][h]["pids"]]
