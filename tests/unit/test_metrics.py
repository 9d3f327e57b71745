"""The agent's /metrics as Prometheus parses it: per-rank phases that add up to the step, per-GPU readings
under DCGM's names, per-op bandwidth, agent health, build info; conventions and bounded labels."""
from __future__ import annotations

import asyncio
import re

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from test_analyzer import simulate

from rankscope.agent.service.http import make_app
from rankscope.agent.service.snapshot import AgentHealth, Snapshot
from rankscope.analyzer.diagnosis import diagnose
from rankscope.schema.patterns import CollectiveGpu, GpuHealth, ThreadTimes

N = 4
SLOW = 2
# rankscope's own names end in a unit (a finding's age is counted in the agent's windows)
UNITS = ("_seconds", "_bytes_per_second", "_ratio", "_total", "_info", "_windows")


def _snapshot() -> Snapshot:
    patterns = simulate(N, sync_extra={SLOW: 0.02})
    for p in patterns:
        p.gpu_health = GpuHealth(index=p.rank, sm_clock_mhz=1410, max_sm_clock_mhz=1980, throttle_reasons=0x40,
                                 power_w=300, temperature_c=71, util_gpu_pct=97, mem_used_mib=40000,
                                 pcie_tx_mbps=12, pcie_rx_mbps=3, nvlink_errors=0, ecc_dbe=0, xids=[79] if p.rank == 1 else [])
        p.sched = {"main": ThreadTimes("main", 1, on_cpu_s=0.5, runq_s=0.01 * (p.rank + 1), sleep_s=1.4, io_s=0.0,
                                       reclaim_s=0.0, preempted=3, runq_p99_s=0.002)}
    patterns[0].collectives_gpu = [CollectiveGpu(op="ncclAllReduce", count=10, total_s=0.05, p99_s=0.006)]
    return Snapshot(patterns=patterns, diagnoses=diagnose(patterns),
                    health=AgentHealth(windows=7, attach_errors=1, drops={"collectives": 0, "python_samples": 3}))


def _scrape(snap: Snapshot) -> tuple[str, dict]:
    async def go():
        async with TestClient(TestServer(make_app(lambda: snap))) as c:
            return await (await c.get("/metrics")).text()

    text = asyncio.run(go())
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def _values(family, **labels) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples
            if all(s.labels.get(k) == v for k, v in labels.items()) and not s.name.endswith("_created")}


def test_rank_phases_add_up_to_the_step_and_name_the_straggler():
    snap = _snapshot()
    _, families = _scrape(snap)
    step = _values(families["rankscope_step_time_seconds"])
    for rank in map(str, range(N)):
        phases = {dict(k)["phase"]: v for k, v in _values(families["rankscope_step_phase_seconds"], rank=rank).items()}
        assert set(phases) == {"gpu_wait", "comm", "data_loading", "host", "python_gc", "other_cuda"}
        assert all(v >= 0 for v in phases.values())
        assert sum(phases.values()) == pytest.approx(step[(("job", "job-a"), ("rank", rank))], rel=1e-3)
    gpu_wait = {dict(k)["rank"]: v for k, v in _values(families["rankscope_step_phase_seconds"], phase="gpu_wait").items()}
    assert max(gpu_wait, key=gpu_wait.get) == str(SLOW)
    assert _values(families["rankscope_finding_cost_ratio"]) == _values(families["rankscope_finding_cost"])
    assert set(_values(families["rankscope_job_step_time_seconds"])) == {(("job", "job-a"),)}
    runq = {dict(k)["rank"]: v for k, v in _values(families["rankscope_run_queue_seconds"]).items()}
    assert sorted(runq, key=runq.get) == ["0", "1", "2", "3"] and all(v > 0 for v in runq.values())


def test_gpus_under_dcgm_names_collectives_health_and_build_info():
    _, families = _scrape(_snapshot())
    temps = _values(families["DCGM_FI_DEV_GPU_TEMP"])
    assert temps[(("gpu", "1"), ("job", "job-a"), ("rank", "1"))] == 71 and len(temps) == N
    assert _values(families["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"], rank="0") == {
        (("gpu", "0"), ("job", "job-a"), ("rank", "0")): 0x40}
    assert set(_values(families["DCGM_FI_DEV_XID_ERRORS"]).values()) == {0, 79}
    assert set(_values(families["DCGM_FI_PROF_PCIE_TX_BYTES"]).values()) == {12e6}
    alg = families["rankscope_collective_algorithm_bandwidth_bytes_per_second"]
    bus = _values(families["rankscope_collective_bus_bandwidth_bytes_per_second"])
    assert {(dict(k)["rank"], dict(k)["collective"], dict(k)["timing_source"]) for k in _values(alg)} == \
        {("0", "AllReduce", "kernel_gpu")} | {(str(r), "AllReduce", "collective_cpu") for r in range(1, N)}
    for key, v in _values(alg).items():
        assert v > 0 and bus[key] == pytest.approx(v * 2 * (N - 1) / N)  # all-reduce's bus factor
    assert _values(families["rankscope_windows"]) == {(): 7}  # counters: the parser strips _total
    assert _values(families["rankscope_attach_errors"]) == {(): 1}
    assert _values(families["rankscope_probe_drops"]) == {(("kind", "collectives"),): 0, (("kind", "python_samples"),): 3}
    (info,) = _values(families["rankscope_build_info"]).items()
    assert info[1] == 1 and dict(info[0])["component"] == "agent" and dict(info[0])["version"]


def test_conventions_and_bounded_labels():
    text, families = _scrape(_snapshot())
    allowed = {"job", "rank", "kind", "phase", "gpu", "collective", "timing_source", "version", "component", "python",
               "node"}
    for name, family in families.items():
        assert {k for s in family.samples for k in s.labels} <= allowed, name
        if name.startswith("rankscope_") and name not in ("rankscope_targets", "rankscope_finding_cost"):
            assert family.type == "counter" or name.endswith(UNITS), name  # counters' samples end in _total
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), name
    assert not re.search(r"cuStreamSynchronize|ncclAllReduce|cuLaunchKernel", text)  # no function names as labels
