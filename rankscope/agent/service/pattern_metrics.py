"""Prometheus families from the last window's rank patterns: each rank's GPU under DCGM's field names (NVML
readings, DCGM's units, so dcgm-exporter dashboards read them), and each collective op's bandwidth as NCCL
Inspector computes it (algbw = bytes / time; busbw = algbw x the op's bus factor), in bytes per second.
Labels stay bounded: job, rank, the GPU's index, and the op from a fixed list (unknown ops are left out)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client.core import GaugeMetricFamily

from rankscope.agent.service.prometheus import gauge
from rankscope.schema.patterns import GpuHealth, RankPattern, Role

MB = 1e6
# (DCGM field, help, reading). NVML's PCIe throughput (KB/s, kept as MB/s) stands in for DCGM's profiling
# field PROF_PCIE_*_BYTES (bytes/s); CLOCKS_EVENT_REASONS is DCGM's current name of CLOCK_THROTTLE_REASONS.
DCGM_FIELDS: tuple[tuple[str, str, Callable[[GpuHealth], float]], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock (MHz), mean over the window.", lambda g: g.sm_clock_mhz),
    ("DCGM_FI_DEV_MAX_SM_CLOCK", "Maximum SM clock (MHz).", lambda g: g.max_sm_clock_mhz),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "Clock event (throttle) reasons seen in the window, a bit mask.",
     lambda g: g.throttle_reasons),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (W).", lambda g: g.power_w),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (C).", lambda g: g.temperature_c),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (%).", lambda g: g.util_gpu_pct),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (MiB).", lambda g: g.mem_used_mib),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "PCIe bytes sent per second.", lambda g: g.pcie_tx_mbps * MB),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "PCIe bytes received per second.", lambda g: g.pcie_rx_mbps * MB),
    ("DCGM_FI_DEV_XID_ERRORS", "The window's last XID error (0: none).", lambda g: g.xids[-1] if g.xids else 0),
)

# NCCL Inspector's collective names and nccl-tests' bus factors (n ranks): the bytes each rank's busiest link
# moves per byte of payload.
COLLECTIVES: dict[str, tuple[str, Callable[[int], float]]] = {
    "allreduce": ("AllReduce", lambda n: 2 * (n - 1) / n),
    "allgather": ("AllGather", lambda n: (n - 1) / n),
    "reducescatter": ("ReduceScatter", lambda n: (n - 1) / n),
    "alltoall": ("AllToAll", lambda n: (n - 1) / n),
    "broadcast": ("Broadcast", lambda n: 1.0),
    "reduce": ("Reduce", lambda n: 1.0),
    "send": ("Send", lambda n: 1.0),
    "recv": ("Recv", lambda n: 1.0),
}


def _collective(function: str) -> str:
    """"ncclAllReduce", "gloo::allreduce" -> "allreduce"."""
    return function.rsplit("::", 1)[-1].removeprefix("nccl").replace("_", "").lower()


def gpu_metrics(patterns: Sequence[RankPattern]) -> list[GaugeMetricFamily]:
    gpus = [p for p in patterns if p.gpu_health is not None and p.state != "exited"]
    labels = ("job", "rank", "gpu")
    return [gauge(name, help_, {(p.job, str(p.rank), str(p.gpu_health.index)): read(p.gpu_health) for p in gpus},
                  labels) for name, help_, read in DCGM_FIELDS] if gpus else []


def collective_metrics(patterns: Sequence[RankPattern]) -> list[GaugeMetricFamily]:
    """Per rank and op over the window: bytes over the GPU-side span of the op (NCCL profiler plugin,
    timing_source kernel_gpu) where known, else over the host's enqueue-to-completion time (collective_cpu,
    which holds waiting for late peers: a lower bound)."""
    alg: dict[tuple[str, ...], float] = {}
    bus: dict[tuple[str, ...], float] = {}
    for p in patterns:
        on_gpu = {_collective(c.op): c.total_s for c in p.collectives_gpu}
        for f in p.functions.values():
            op = _collective(f.name)
            if f.role != Role.COMM or op not in COLLECTIVES or f.bytes <= 0:
                continue
            name, factor = COLLECTIVES[op]
            seconds, source = (on_gpu[op], "kernel_gpu") if on_gpu.get(op) else (f.total_s, "collective_cpu")
            if seconds <= 0:
                continue
            key = (p.job, str(p.rank), name, source)
            alg[key] = f.bytes / seconds
            bus[key] = alg[key] * factor(max(p.world_size, 1))
    labels = ("job", "rank", "collective", "timing_source")
    return [
        gauge("rankscope_collective_algorithm_bandwidth_bytes_per_second",
              "Payload bytes of a collective op over its time in the window (NCCL Inspector's algbw).", alg, labels),
        gauge("rankscope_collective_bus_bandwidth_bytes_per_second",
              "Algorithm bandwidth times the op's bus factor (NCCL Inspector's busbw).", bus, labels),
    ]
