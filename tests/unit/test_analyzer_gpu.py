"""gpu_throttle and launch_bound on synthetic patterns (the simulated job of test_analyzer, plus GPU views)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_analyzer import WINDOW, findings, set_function, simulate

from rankscope.schema.patterns import FunctionColumns, FunctionStats, GpuActivity, GpuHealth, GpuKernel, Role


def health(index: int, clock: int, reasons: int = 0, temperature: int = 62) -> GpuHealth:
    return GpuHealth(index=index, sm_clock_mhz=clock, max_sm_clock_mhz=1980, throttle_reasons=reasons, power_w=650,
                     temperature_c=temperature, util_gpu_pct=98, mem_used_mib=70_000, pcie_tx_mbps=1000,
                     pcie_rx_mbps=3000, nvlink_errors=0, ecc_dbe=0)


def with_health(patterns, hot: dict[int, GpuHealth]):
    for p in patterns:
        p.gpu_health = hot.get(p.rank) or health(p.rank, 1980 - 5 * p.rank)
    return patterns


def test_throttled_gpu_on_the_straggler_is_the_root_cause():
    ps = with_health(simulate(8, sync_extra={5: 0.030}, seed=3), {5: health(5, 1395, 0x20 | 0x8, 88)})
    fs = findings(ps)
    assert [(f["kind"], f["ranks"], f["component"]) for f in fs] == [("gpu_throttle", [5], "gpu")]
    f = fs[0]
    assert f["evidence"]["throttle_reasons"] == ["hardware slowdown", "software thermal slowdown"]
    assert f["evidence"]["sm_clock_mhz"] == 1395 and f["cost"] == pytest.approx(0.030 / 0.078, abs=0.06)
    assert "GPU 5 runs at 1395 MHz" in f["summary"] and "software thermal slowdown" in f["summary"]


def test_low_clock_without_a_reason_or_without_straggling_is_not_throttle():
    # Rank 5 straggles but its GPU runs at full clocks: a plain compute straggler.
    ps = with_health(simulate(8, sync_extra={5: 0.030}, seed=3), {})
    assert [f["kind"] for f in findings(ps)] == ["compute_straggler"]
    # Low clock with a power-cap reason on a rank that keeps up (it has slack): no finding at all.
    ps = with_health(simulate(8, seed=3), {2: health(2, 1500, 0x4)})
    assert findings(ps) == []
    # Low clock with no slowdown reason (idle bit only): still the plain straggler.
    ps = with_health(simulate(8, sync_extra={5: 0.030}, seed=3), {5: health(5, 1395, 0x1)})
    assert [f["kind"] for f in findings(ps)] == ["compute_straggler"]


def gpu(busy_s: float, kernels: int, kernel_s: float) -> GpuActivity:
    return GpuActivity(busy_s=busy_s, kernel_s=kernel_s, copy_s=0.0, kernels=kernels,
                       top=[GpuKernel("vectorized_elementwise_kernel", kernels, kernel_s)])


def test_launch_bound_when_gpu_idles_between_short_kernels():
    ps = simulate(4, seed=1)
    for p in ps:
        set_function(p, replace(p.functions["cuStreamSynchronize"], total_s=0.05))  # the host hardly waits for its GPU
        p.gpu = gpu(busy_s=0.7, kernels=40_000, kernel_s=0.7)  # 17.5 us kernels, busy 35% of 2 s
    fs = [f for f in findings(ps) if f["kind"] == "launch_bound"]
    assert len(fs) == 1
    f = fs[0]
    assert (f["ranks"], f["component"], f["function"]) == ([0, 1, 2, 3], "host", "cuLaunchKernel")
    copies = np.median([p.time_in(Role.COPY) for p in ps])  # the host waits in copies: not the launch path's
    assert f["cost"] == pytest.approx(1 - (0.7 + copies) / WINDOW)
    assert f["evidence"]["mean_kernel_us"] == pytest.approx(17.5)
    assert "idle 62%" in f["summary"]


def test_ranks_waiting_in_host_collectives_are_not_launch_bound():
    """The GPU of a rank waiting for a straggler in gloo idles, launching nothing: that wait explains it. NCCL's
    collectives run on the GPU (its busy time), so their host-side time explains nothing."""
    ps = simulate(4, seed=1)
    for p in ps:
        set_function(p, replace(p.functions["cuStreamSynchronize"], total_s=0.05))
        p.gpu = gpu(busy_s=0.7, kernels=40_000, kernel_s=0.7)
        set_function(p, FunctionStats("gloo_allreduce", Role.COMM, 40, 0.7, 0.02, 0.017, 0.02))
    assert [f for f in findings(ps) if f["kind"] == "launch_bound"] == []
    for p in ps:
        gloo = p.functions["gloo_allreduce"]
        p.functions = FunctionColumns.of({**{n: f for n, f in p.functions.items() if n != gloo.name},
                                          "ncclAllReduce": replace(gloo, name="ncclAllReduce")})
    assert [f["kind"] for f in findings(ps) if f["kind"] == "launch_bound"] == ["launch_bound"]


@pytest.mark.parametrize("busy,kernels,kernel_s,sync_s", [
    (1.8, 40_000, 1.8, 0.05),   # GPU busy 90%: not idle
    (0.7, 400, 0.7, 0.05),      # idle, but long kernels (1.75 ms): not the launch path
    (0.7, 40_000, 0.7, 0.9),    # idle while the host waits on syncs: the host is not the bottleneck
    (0.7, 2_000, 0.035, 0.05),  # short kernels 0.6 ms apart: the host busy with other work than launching
])
def test_not_launch_bound(busy, kernels, kernel_s, sync_s):
    ps = simulate(4, seed=1)
    for p in ps:
        set_function(p, replace(p.functions["cuStreamSynchronize"], total_s=sync_s))
        p.gpu = gpu(busy, kernels, kernel_s)
    assert [f for f in findings(ps) if f["kind"] == "launch_bound"] == []


def test_launch_bound_evidence_has_the_queue_delay_and_a_queued_rank_is_not_launch_bound():
    """Deep mode joins launches to kernels: a median queue delay near zero confirms the GPU waits for the host;
    a long one (the host ahead of a busy GPU) takes the rank out of launch_bound, whatever else it shows."""
    ps = simulate(4, seed=1)
    for p in ps:
        set_function(p, replace(p.functions["cuStreamSynchronize"], total_s=0.05))
        p.gpu = gpu(busy_s=0.7, kernels=40_000, kernel_s=0.7)
        p.gpu.launches, p.gpu.queue_p50_s, p.gpu.queue_p99_s = 39_990, 2 ** 12.5 / 1e9, 2 ** 14.5 / 1e9
    ps[2].gpu.queue_p50_s, ps[2].gpu.queue_p99_s = 2 ** 20.5 / 1e9, 2 ** 22.5 / 1e9  # ~1.5 ms in the queue
    fs = [f for f in findings(ps) if f["kind"] == "launch_bound"]
    assert len(fs) == 1 and fs[0]["ranks"] == [0, 1, 3]
    ev = fs[0]["evidence"]
    assert ev["queue_p50_us"] == pytest.approx(5.79, abs=0.01)
    assert [r["queue_p99_us"] for r in ev["per_rank"]] == pytest.approx([2 ** 14.5 / 1e3] * 3, abs=1e-3)
    assert "each kernel starting 6 us after its launch" in fs[0]["summary"]

    for p in ps:  # every rank queued: no launch_bound at all
        p.gpu.queue_p50_s = 2 ** 20.5 / 1e9
    assert [f for f in findings(ps) if f["kind"] == "launch_bound"] == []


def test_ranks_without_gpu_views_are_unchanged():
    assert findings(simulate(8, seed=3)) == []
    assert [f["kind"] for f in findings(simulate(8, sync_extra={5: 0.030}, seed=3))] == ["compute_straggler"]
