"""The NVML health reader on recorded readings (tests/data/nvml_readings.json), and without NVML."""
from __future__ import annotations

import logging

import pynvml
from nvml_replay import READINGS, ReplayNvml

from rankscope.agent.sources.nvml import GpuHealthReader
from rankscope.schema.patterns import GpuHealth


def test_windows_of_recorded_readings():
    nvml = ReplayNvml(READINGS)
    reader = GpuHealthReader(nvml)
    assert reader.available and len(reader.devices) == 4
    assert reader.device_of() == {4101: 0, 4102: 1, 4103: 2}

    reader.sample()
    nvml.advance()
    reader.sample()
    first = reader.window()  # NVLink: 7 at the end, 3 when the reader started
    assert first[2] == GpuHealth(index=2, sm_clock_mhz=1402, max_sm_clock_mhz=1980, throttle_reasons=0x28,
                                 power_w=700, temperature_c=88, util_gpu_pct=99, mem_used_mib=71680,
                                 pcie_tx_mbps=1200, pcie_rx_mbps=3400, nvlink_errors=4, ecc_dbe=0, xids=[79])
    assert first[0].throttle_reasons == 0x4 and first[0].sm_clock_mhz == 1972 and first[0].power_w == 677
    assert first[3].ecc_dbe == 0 and first[3].nvlink_errors == 0  # no NVLink, no ECC: zero, not an error

    nvml.advance()
    reader.sample()
    nvml.advance()
    reader.sample()
    second = reader.window()
    assert second[2].nvlink_errors == 0 and second[2].ecc_dbe == 1 and second[2].xids == []  # counters per window
    assert second[1].throttle_reasons == 0 and second[1].sm_clock_mhz == 345  # idle is not a slowdown
    reader.close()
    assert not reader.available


def test_without_nvml_says_so_once_and_reports_nothing(caplog):
    class NoNvml(ReplayNvml):
        def nvmlInit(self) -> None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    with caplog.at_level(logging.INFO, logger="rankscope.agent.sources.nvml"):
        reader = GpuHealthReader(NoNvml(READINGS))
        reader.sample()
        assert reader.window() == {} and reader.device_of() == {}
    assert not reader.available
    assert [r.message for r in caplog.records if "NVML" in r.message] == [
        "no NVML on this machine (NVML Shared Library Not Found): GPU health is not reported"]


def test_real_pynvml_on_this_machine_degrades_cleanly():
    """This machine has no NVIDIA driver: the real pynvml fails to load libnvidia-ml, the reader runs without."""
    reader = GpuHealthReader()
    if reader.available:  # a GPU machine: real readings, at least the shape
        reader.sample()
        assert all(h.max_sm_clock_mhz > 0 for h in reader.window().values())
        reader.close()
    else:
        assert reader.window() == {}
